//! Who may call the HTTP API and how much: hosts, roles, failed authentications, slow
//! uploads and requests past the limit — against the API served over TCP with the client's
//! address, on the real Postgres.

use std::time::Duration;

use jobfold_common::config::{ApiToken, Role};
use jobfold_processor::access::digest_hex;
use jobfold_tests::harness::{Installation, eventually_some, http_client, index_job};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const READ: &str = "jf_access_read_0123456789";
const SUBMIT: &str = "jf_access_submit_0123456789";
const OPERATE: &str = "jf_access_operate_0123456789";
const ADMIN: &str = "jf_access_admin_0123456789";

/// Serves the API of `it` on a port of its own, with the clients' addresses; its base URL.
async fn serve(it: &Installation) -> (String, CancellationToken) {
    let app = jobfold_processor::http::router(it.api_state().await, 64 * 1024);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(jobfold_processor::http::serve_on(listener, app, stop.clone()));
    (base, stop)
}

fn tokens() -> Vec<ApiToken> {
    [
        ("viewer", Role::Read, READ),
        ("upstream", Role::Submit, SUBMIT),
        ("oncall", Role::Operate, OPERATE),
        ("root", Role::Admin, ADMIN),
    ]
    .into_iter()
    .map(|(name, role, secret)| ApiToken { name: name.into(), role, sha256: digest_hex(secret) })
    .collect()
}

/// A page that rebinds its own name to the API's address sends that name as `Host`: it is
/// answered 421 before any handler runs — on an API without tokens (the default) and with
/// the right token alike; the probes answer any `Host`; a listed name is answered.
#[tokio::test(flavor = "multi_thread")]
async fn a_rebound_host_is_refused_before_any_handler_with_or_without_a_token() {
    let mut it = Installation::new("access-host").await;
    let job =
        it.acceptor().await.accept(&it.pool, &index_job("doc-host", 1, json!({}))).await.unwrap();
    it.config.http.allowed_hosts = vec!["jobs.internal".into()];
    let (base, stop) = serve(&it).await;
    let client = http_client();
    let cancel = format!("{base}/v1/jobs/{}/cancel", job.job_id);
    let refused =
        client.post(&cancel).header("host", "rebound.evil.example:8080").send().await.unwrap();
    assert_eq!(refused.status(), 421);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "host_not_allowed", "{body}");
    let read =
        client.get(format!("{base}/v1/jobs/{}", job.job_id)).header("host", "evil.example").send();
    assert_eq!(read.await.unwrap().status(), 421);
    assert_eq!(
        it.state_and_attempt(job.job_id).await.0,
        "queued",
        "the rebound cancel reached nothing"
    );
    let probe = client.get(format!("{base}/healthz")).header("host", "10.1.2.3:8080").send();
    assert_eq!(probe.await.unwrap().status(), 200, "a probe addresses the process by its IP");
    let listed =
        client.get(format!("{base}/v1/jobs/{}", job.job_id)).header("host", "jobs.internal").send();
    assert_eq!(listed.await.unwrap().status(), 200);
    stop.cancel();

    // With tokens: the right one does not make a foreign Host pass.
    it.config.http.tokens = tokens();
    let (base, stop) = serve(&it).await;
    let refused = client
        .post(format!("{base}/v1/jobs/{}/cancel", job.job_id))
        .bearer_auth(ADMIN)
        .header("host", "rebound.evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 421);
    assert_eq!(it.state_and_attempt(job.job_id).await.0, "queued");
    stop.cancel();
    it.cleanup().await;
}

/// Each role may do what it names and no more: `read` reads but is refused a cancel (403)
/// and a submit; `submit` accepts jobs but cancels nothing; `operate` cancels but deletes
/// nothing; `admin` deletes. The scheme is matched in any case; no token or a wrong one is
/// 401; the probes and `/metrics` need none. Each change is in the audit trail under the
/// token's name.
#[tokio::test(flavor = "multi_thread")]
async fn roles_allow_what_they_name_and_a_read_token_is_refused_a_cancel() {
    let mut it = Installation::new("access-roles").await;
    let job =
        it.acceptor().await.accept(&it.pool, &index_job("doc-roles", 1, json!({}))).await.unwrap();
    it.config.http.tokens = tokens();
    let (base, stop) = serve(&it).await;
    let client = http_client();
    let status = |request: reqwest::RequestBuilder| async move {
        request.send().await.unwrap().status().as_u16()
    };
    let job_url = format!("{base}/v1/jobs/{}", job.job_id);
    let cancel = format!("{job_url}/cancel");
    let submit = json!({ "document_id": "doc-new", "kind": "index-document", "input_version": 1, "input": {} });

    assert_eq!(status(client.get(&job_url)).await, 401, "a read without a token");
    assert_eq!(
        status(client.get(&job_url).header("authorization", "Bearer wrong-token-123")).await,
        401
    );
    assert_eq!(status(client.get(format!("{base}/healthz"))).await, 200);
    assert_eq!(status(client.get(format!("{base}/readyz"))).await, 200);
    assert_ne!(
        status(client.get(format!("{base}/metrics"))).await,
        401,
        "/metrics is open by default"
    );
    assert_eq!(status(client.get(format!("{base}/ui/"))).await, 200, "the console's page signs in");

    // read
    assert_eq!(
        status(client.get(&job_url).header("authorization", format!("bearer {READ}"))).await,
        200
    );
    assert_eq!(
        status(
            client
                .get(format!("{job_url}/input"))
                .header("authorization", format!("BEARER {READ}"))
        )
        .await,
        200
    );
    let refused = client.post(&cancel).bearer_auth(READ).send().await.unwrap();
    assert_eq!(refused.status(), 403, "a read token's cancel");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("operate"), "{body}");
    assert_eq!(
        status(client.post(format!("{base}/v1/jobs")).bearer_auth(READ).json(&submit)).await,
        403
    );
    // submit
    assert_eq!(
        status(client.post(format!("{base}/v1/jobs")).bearer_auth(SUBMIT).json(&submit)).await,
        201
    );
    assert_eq!(status(client.post(&cancel).bearer_auth(SUBMIT)).await, 403);
    assert_eq!(
        it.state_and_attempt(job.job_id).await.0,
        "queued",
        "refused cancels changed nothing"
    );
    // operate
    let cancelled = client
        .post(&cancel)
        .bearer_auth(OPERATE)
        .header("x-request-id", "req-cancel-1")
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    assert_eq!(cancelled.headers()["x-request-id"], "req-cancel-1");
    assert_eq!(it.state_and_attempt(job.job_id).await.0, "cancelled");
    let letter = format!("{base}/v1/dead-letters/424242");
    assert_eq!(status(client.delete(&letter).bearer_auth(OPERATE)).await, 403);
    // admin: past the access check (there is no such dead letter).
    assert_eq!(status(client.delete(&letter).bearer_auth(ADMIN)).await, 404);

    let auth: Value = client
        .post(format!("{base}/v1/auth"))
        .bearer_auth(OPERATE)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((auth["name"].as_str(), auth["role"].as_str()), (Some("oncall"), Some("operate")));

    let trail: Value = client
        .get(format!("{base}/v1/audit"))
        .bearer_auth(READ)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let entries = trail["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "only the cancel changed anything: {trail}");
    let entry = &entries[0];
    assert_eq!(
        (&entry["actor"], &entry["role"], &entry["via"], &entry["action"], &entry["request_id"]),
        (
            &json!("oncall"),
            &json!("operate"),
            &json!("api"),
            &json!("cancel"),
            &json!("req-cancel-1")
        ),
        "{entry}"
    );
    assert_eq!(entry["target"], job.job_id.to_string());
    assert_eq!(entry["detail"]["was"], "queued");
    stop.cancel();
    it.cleanup().await;
}

/// A brute force of 100 wrong tokens from one address: the first
/// `http.auth_failures_per_minute` are answered 401, the rest 429 with `Retry-After`, and
/// then the right token too (until the minute is over); a request without any token is not
/// a guess and is not counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_brute_force_of_100_wrong_tokens_is_refused_after_the_limit() {
    let mut it = Installation::new("access-brute").await;
    it.config.http.tokens = tokens();
    it.config.http.auth_failures_per_minute = 10;
    let (base, stop) = serve(&it).await;
    let client = http_client();
    let overview = format!("{base}/v1/overview");
    for _ in 0..20 {
        let none = client.get(&overview).send().await.unwrap();
        assert_eq!(none.status(), 401, "no token: not a guess");
    }
    let mut answers = Vec::new();
    for n in 0..100 {
        let answer = client
            .get(&overview)
            .bearer_auth(format!("guess-{n:04}-0123456789"))
            .send()
            .await
            .unwrap();
        if answer.status() == 429 {
            let wait: u64 = answer.headers()["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=60).contains(&wait), "{wait}");
        }
        answers.push(answer.status().as_u16());
    }
    assert_eq!(&answers[..10], &[401; 10]);
    assert!(answers[10..].iter().all(|s| *s == 429), "{answers:?}");
    let right = client.get(&overview).bearer_auth(READ).send().await.unwrap();
    assert_eq!(right.status(), 429, "the right token from a locked-out address");
    stop.cancel();
    it.cleanup().await;
}

/// `jobfold token` makes a secret whose printed entry the API takes: the configuration
/// holds only its SHA-256.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_the_cli_makes_signs_in_with_its_role() {
    let mut it = Installation::new("access-cli-token").await;
    let output = jobfold_tests::harness::jobfold_cli()
        .envs(it.env())
        .args(["token", "--name", "dashboards", "--role", "read"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let secret = text.split("): ").nth(1).and_then(|r| r.lines().next()).unwrap().trim().to_owned();
    let digest = text
        .lines()
        .find_map(|l| l.strip_prefix("sha256 = \""))
        .unwrap()
        .trim_end_matches('"')
        .to_owned();
    assert!(!text.contains(&format!("sha256 = \"{secret}")), "{text}");
    assert_eq!(digest, digest_hex(&secret));
    it.config.http.tokens =
        vec![ApiToken { name: "dashboards".into(), role: Role::Read, sha256: digest }];
    let (base, stop) = serve(&it).await;
    let answer =
        http_client().post(format!("{base}/v1/auth")).bearer_auth(&secret).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    let auth: Value = answer.json().await.unwrap();
    assert_eq!((auth["name"].as_str(), auth["role"].as_str()), (Some("dashboards"), Some("read")));
    stop.cancel();
    it.cleanup().await;
}

/// Sends a request's headers and the start of a 1,000-byte body, then nothing.
async fn stalled_upload(addr: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/jobs HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: 1000\r\n\r\n{{\"kind\": "
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// What the server answered on `stream`, until it closed it.
async fn answer_on(mut stream: tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(120), stream.read_to_end(&mut answer));
    read.await.expect("no answer in two minutes").unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// Uploads that trickle hold their request slot only until `http.request_timeout` (408
/// `request_timeout`); past `http.max_concurrent_requests` one more request is answered 503
/// `overloaded` at once, not queued, while the health check still answers; once the slots
/// are free again a request is served.
#[tokio::test(flavor = "multi_thread")]
async fn slow_uploads_are_cut_off_and_requests_past_the_limit_are_refused_not_queued() {
    let mut it = Installation::new("access-bounds").await;
    it.config.http.max_concurrent_requests = 2;
    it.config.accept.commit_timeout = Duration::from_secs(1);
    it.config.http.request_timeout = Duration::from_secs(3);
    let (base, stop) = serve(&it).await;
    let addr = base.trim_start_matches("http://").to_owned();
    let stalled = [stalled_upload(&addr).await, stalled_upload(&addr).await];
    let client = http_client();
    let overview = format!("{base}/v1/overview");
    let refused = eventually_some(Duration::from_secs(30), "a third request refused", || async {
        let answer = client.get(&overview).send().await.unwrap();
        (answer.status() == 503).then_some(answer)
    })
    .await;
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    let health = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200, "the health check is not held to the limit");
    for stream in stalled {
        let answer = answer_on(stream).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("\"request_timeout\""), "{answer}");
    }
    let served = client.get(&overview).send().await.unwrap();
    assert_eq!(served.status(), 200, "{:?}", served.text().await);
    stop.cancel();
    it.cleanup().await;
}

/// `jobfold --api URL --token T` makes its changes through the API: with a database URL
/// that leads nowhere it submits, runs now and cancels, each answered as without --api;
/// the audit trail names the token and says "api"; a token without the role is refused
/// with the API's own words; a command with no API form, or a URL that is none, exits 2.
#[tokio::test(flavor = "multi_thread")]
async fn the_command_line_changes_jobs_through_the_api_under_its_token() {
    let mut it = Installation::new("access-cli").await;
    it.config.http.tokens = tokens();
    let (base, stop) = serve(&it).await;
    let later = |document: &str| {
        let mut job = index_job(document, 1, json!({}));
        job.run_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
        job
    };
    let acceptor = it.acceptor().await;
    let scheduled = acceptor.accept(&it.pool, &later("doc-cli-now")).await.unwrap().job_id;
    let to_cancel = acceptor.accept(&it.pool, &later("doc-cli-cancel")).await.unwrap().job_id;
    // Whatever goes to Postgres from the command line fails: only the API can do the work.
    let cli = |token: &str, args: &[&str]| {
        let output = jobfold_tests::harness::jobfold_cli()
            .envs(it.env())
            .env("JOBFOLD_DATABASE_URL", "postgres://jobfold@127.0.0.1:1/nowhere")
            .env("JOBFOLD_API", &base)
            .env("JOBFOLD_TOKEN", token)
            .args(args)
            .output()
            .unwrap();
        let said = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_owned();
        (output.status.code(), said(&output.stdout), said(&output.stderr))
    };

    let (code, out, err) = cli(OPERATE, &["run-now", &scheduled.to_string()]);
    assert_eq!(
        (code, out),
        (Some(0), format!("{scheduled} was scheduled for later: dispatched now")),
        "{err}"
    );
    let cancel = ["cancel", &to_cancel.to_string(), "--reason", "moved"];
    let (code, out, err) = cli(OPERATE, &cancel);
    assert_eq!((code, out), (Some(0), format!("{to_cancel} cancelled (was queued)")), "{err}");
    let (code, out, err) = cli(OPERATE, &cancel);
    assert_eq!((code, out), (Some(0), format!("{to_cancel} was already cancelled")), "{err}");
    let submit = ["submit", "--document", "doc-cli-new", "--key", "cli-1", "--delay", "1h"];
    let (code, first, err) = cli(SUBMIT, &submit);
    assert_eq!(code, Some(0), "{err}");
    let (_, again, _) = cli(SUBMIT, &submit);
    let id = first.strip_suffix(" accepted").expect(&first);
    assert_eq!(again, format!("{id} already accepted"));
    assert_eq!(it.state_and_attempt(to_cancel).await.0, "cancelled");
    assert_eq!(it.state_and_attempt(id.parse().unwrap()).await.0, "queued");

    let filter = jobfold_processor::store::audit::AuditFilter {
        target: Some(to_cancel.to_string()),
        ..Default::default()
    };
    let audited = jobfold_processor::store::audit::list(&it.pool, &filter).await.unwrap();
    let said: Vec<(&str, &str, &str)> = audited
        .entries
        .iter()
        .map(|e| (e.actor.as_str(), e.via.as_str(), e.action.as_str()))
        .collect();
    assert_eq!(said, [("oncall", "api", "cancel")], "the repeat changed nothing and logs nothing");

    // The read-only token may not run a job now: the API's refusal, in its words.
    let (code, _, err) = cli(READ, &["run-now", &scheduled.to_string()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("403") && err.contains(&format!("/v1/jobs/{scheduled}/run-now")), "{err}");
    let (code, _, err) = cli(OPERATE, &["jobs"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--api: `jobfold jobs` has no API form"), "{err}");
    let (code, _, err) =
        cli(OPERATE, &["--api", "localhost:8080", "status", &scheduled.to_string()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is not an http:// or https:// URL"), "{err}");
    stop.cancel();
    it.cleanup().await;
}
