//! The operator console at `/ui`, driven in a real headless Chromium against a real pipeline
//! (Postgres, Kafka, the registry, a relay and a processor as processes): the overview shows
//! what the API returns for a seeded workload and keeps its layout as it refreshes; a job is
//! found by document and by id; a quarantined job is replayed from its page and succeeds,
//! once; a bulk replay counts first and asks; a scheduled job is cancelled once confirmed, another run now; a kind is paused with a reason (its new job
//! waits, counted) and resumed (the job runs once); a dead letter is shown, re-injected and
//! deleted; HTML and script in user data are shown as text; a change without the token, with
//! a wrong one, or from another origin is refused; the pages fit a phone and are reachable by
//! keyboard. Screenshots of each page go to `target/console/`.

use std::time::Duration;

use chrono::Utc;
use fantoccini::key::Key;
use jobfold_schemas::{Codec, JobRequest};
use jobfold_tests::browser::Browser;
use jobfold_tests::harness::{
    Installation, OPERATE_TOKEN, READ_TOKEN, Running, SUBMIT_TOKEN, eventually, http_client,
    index_job, metric_value,
};
use serde_json::{Value, json};
use uuid::Uuid;

const TOKEN: &str = "console-test-token-0123456789";
/// A document id and an input that would run script if the page parsed them as markup.
const HTML_DOCUMENT: &str = "<img src=x onerror=\"window.__pwned='document'\">doc-html";
const HTML_TEXT: &str =
    "<script>window.__pwned='input'</script><b id=injected>bold</b> words to index";

/// Script that counts what an injection would have added to the page.
const INJECTED: &str = "return { pwned: window.__pwned === undefined ? null : window.__pwned, \
     elements: document.querySelectorAll('#injected, img[src=\"x\"], main script').length };";

/// A document id with a right-to-left override: shown raw, it reads "invoiceexe.jpg".
const BIDI_DOCUMENT: &str = "invoice\u{202E}gpj.exe";
/// How the console shows it.
const BIDI_SHOWN: &str = "invoice⟦U+202E⟧gpj.exe";
/// The trace of the job with that document, and where the console links it.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACE_URL: &str = "https://traces.example/trace/{trace_id}";

/// Seeds the installation; the job ids by role.
struct Seeded {
    ok: Vec<Uuid>,
    quarantined: Vec<Uuid>,
    html: Uuid,
    large: Uuid,
    bidi: Uuid,
}

async fn seed(it: &Installation, running: &Running) -> Seeded {
    let acceptor = it.acceptor().await;
    let accept = |document: String, input: Value| {
        let acceptor = acceptor.clone();
        async move { acceptor.accept(&it.pool, &index_job(&document, 1, input)).await.unwrap().job_id }
    };
    let mut ok = Vec::new();
    for i in 0..5 {
        ok.push(
            accept(format!("doc-ok-{i}"), json!({ "text": format!("hello number {i}") })).await,
        );
    }
    let mut quarantined = Vec::new();
    for i in 0..3 {
        let input = json!({ "text": "refused", "simulate": { "permanent_until_replayed": true } });
        quarantined.push(accept(format!("doc-q-{i}"), input).await);
    }
    let html = accept(HTML_DOCUMENT.into(), json!({ "text": HTML_TEXT })).await;
    let large =
        accept("doc-large".into(), json!({ "text": "big", "simulate": { "output_bytes": 9000 } }))
            .await;
    let mut traced = index_job(BIDI_DOCUMENT, 1, json!({ "text": "an invoice" }));
    traced.trace = jobfold_schemas::event::TraceContext::from_headers(
        &format!("00-{TRACE_ID}-00f067aa0ba902b7-01"),
        None,
    );
    let bidi = acceptor.accept(&it.pool, &traced).await.unwrap().job_id;

    // A request of a kind nothing runs yet: the intake dead-letters it.
    let codec: Codec<JobRequest> =
        Codec::connect(it.registry(), &it.config.topics.requests).await.unwrap();
    let request = JobRequest {
        request_id: Uuid::now_v7(),
        document_id: HTML_DOCUMENT.into(),
        job_kind: "late-kind".into(),
        input_version: 1,
        input: json!({ "text": HTML_TEXT }).to_string(),
        requested_at: Utc::now(),
        producer: "upstream".into(),
        trace: None,
        run_at: None,
    };
    let producer: rdkafka::producer::FutureProducer = it.config.kafka_client().create().unwrap();
    let frame = codec.encode(&request).unwrap();
    let record = rdkafka::producer::FutureRecord::to(&it.config.topics.requests)
        .key("doc-html")
        .payload(&frame);
    producer.send(record, Duration::from_secs(30)).await.unwrap();

    eventually(Duration::from_secs(90), "the seeded jobs to end", || async {
        let (_, overview) = running.get("/v1/overview").await;
        overview["unfinished"] == 0
            && overview["quarantined_total"] == 3
            && overview["dead_letters"] == 1
    })
    .await;
    Seeded { ok, quarantined, html, large, bidi }
}

async fn state(it: &Installation, job_id: Uuid) -> String {
    it.state_and_attempt(job_id).await.0
}

/// Business writes committed for `job_id` (the test handler's audit).
async fn writes(it: &Installation, job_id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM index_writes WHERE job_id = $1")
        .bind(job_id)
        .fetch_one(&it.pool)
        .await
        .unwrap()
}

/// Signs in with `token` through the form (opened if it is not), as `who` ("viewer (read)").
async fn sign_in(browser: &Browser, token: &str, who: &str) {
    browser
        .js("if (document.getElementById('login').hidden) document.getElementById('sign-in-open').click();")
        .await;
    browser.until("the sign-in form", "return !document.getElementById('login').hidden;").await;
    browser.fill("#login-token", token).await;
    browser.click("#login-form button[type=submit]").await;
    browser
        .until(
            "signed in",
            &format!(
                "return document.getElementById('session-state').textContent === {};",
                json!(format!("Signed in as {who}"))
            ),
        )
        .await;
}

/// `text` for a URL's query.
fn urlencoding(text: &str) -> String {
    let mut url = reqwest::Url::parse("http://query.invalid/").unwrap();
    url.query_pairs_mut().append_pair("v", text);
    url.query().unwrap_or_default().trim_start_matches("v=").to_owned()
}

/// Whether the element `css` selects is laid out (not hidden by its role's rule or a parent).
async fn rendered(browser: &Browser, css: &str) -> bool {
    browser
        .js(&format!(
            "const e = document.querySelector({}); return Boolean(e && e.getClientRects().length);",
            json!(css)
        ))
        .await
        == json!(true)
}

/// The numbers in a tile's text ("1,234" → 1234).
fn number(text: &str) -> i64 {
    text.replace(',', "").trim().parse().unwrap_or_else(|_| panic!("not a count: {text:?}"))
}

/// History as processors record it: the ten minutes before this one on the overview (the
/// third-last the busiest: 6,000 accepted, 100 a second), and two minutes of a kind no
/// processor here runs — 47 succeeded, 2 failed, 1 quarantined; waits all ≤ 50 ms; runs 46
/// ≤ 250 ms and 4 ≤ 5 s (p50 250 ms, p99 5 s). The console's processor, already running,
/// may have recorded the minute that just ended (it never overwrites a row): the seed's
/// figures replace the processor's.
async fn seed_history(it: &Installation) {
    use jobfold_processor::history::{BUCKETS, bucket};
    sqlx::query(
        "INSERT INTO overview_minutes (minute, accepted, unfinished, quarantined, relay_backlog) \
         SELECT date_trunc('minute', now()) - make_interval(mins => i), \
                CASE WHEN i = 3 THEN 6000 ELSE 60 * i END, 5, 3, 0 \
         FROM generate_series(1, 10) i \
         ON CONFLICT (minute) DO UPDATE SET accepted = EXCLUDED.accepted, \
             unfinished = EXCLUDED.unfinished, quarantined = EXCLUDED.quarantined, \
             relay_backlog = EXCLUDED.relay_backlog",
    )
    .execute(&it.pool)
    .await
    .unwrap();
    let histogram = |pairs: &[(u64, i32)]| {
        let mut h = vec![0_i32; BUCKETS];
        for (ms, n) in pairs {
            h[bucket(Duration::from_millis(*ms))] += n;
        }
        h
    };
    for (ago, runs, succeeded, failed, quarantined, wait, run) in [
        (4, 40, 37, 2, 1, histogram(&[(40, 40)]), histogram(&[(200, 36), (3000, 4)])),
        (2, 10, 10, 0, 0, histogram(&[(40, 10)]), histogram(&[(200, 10)])),
    ] {
        sqlx::query(
            "INSERT INTO kind_minutes (minute, kind, owner, runs, succeeded, failed, quarantined, \
                                       superseded, cancelled, wait_ms, run_ms) \
             VALUES (date_trunc('minute', now()) - make_interval(mins => $1), 'seeded-kind', \
                     'seeded/1', $2, $3, $4, $5, 0, 0, $6, $7)",
        )
        .bind(ago)
        .bind(runs)
        .bind(succeeded)
        .bind(failed)
        .bind(quarantined)
        .bind(&wait)
        .bind(&run)
        .execute(&it.pool)
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_shows_finds_fixes_and_escapes_in_a_real_browser() {
    let mut it = Installation::new("console").await;
    it.config.processor.group = jobfold_tests::kafka::unique_name("processors");
    it.create_topics().await;
    let running = Running::start(&it, TOKEN, &[("JOBFOLD_CONSOLE__TRACE_URL", TRACE_URL)]);
    running.ready().await;
    let seeded = seed(&it, &running).await;
    seed_history(&it).await;
    let ui = running.url("/ui/");
    let browser = Browser::start(1280, 900).await;

    // --- Signed out, the page shows nothing but the sign-in form; a read token shows it all. ---
    browser.goto(&running.url("/ui")).await;
    browser.until("the sign-in form", "return !document.getElementById('login').hidden;").await;
    assert_eq!(browser.text("#session-state").await, "Signed out");
    sign_in(&browser, READ_TOKEN, "viewer (read)").await;

    // --- Overview: the numbers the API returns, and the seeded truth. ---
    browser
        .until(
            "the first reading",
            "return document.getElementById('updated').textContent.startsWith('Updated');",
        )
        .await;
    let (_, api) = running.get("/v1/overview").await;
    for key in [
        "unfinished",
        "quarantined_total",
        "dead_letters",
        "expired_leases",
        "scheduled",
        "relay_parked",
    ] {
        let shown = number(&browser.text(&format!("[data-metric='{key}']")).await);
        assert_eq!(shown, api[key].as_i64().unwrap(), "tile {key}");
    }
    assert_eq!(number(&browser.text("[data-metric='quarantined_total']").await), 3);
    assert_eq!(number(&browser.text("[data-metric='dead_letters']").await), 1);
    assert_eq!(number(&browser.text("[data-metric='unfinished']").await), 0);
    let owner = api["quarantined"].as_object().unwrap().keys().next().unwrap().clone();
    assert_eq!(number(&browser.text(&format!("[data-owner='{owner}']")).await), 3);
    // Every partition of both groups, with the lag Kafka reports.
    let lag = api["consumer_lag"].as_array().unwrap();
    assert_eq!(lag.len(), 2 * it.config.topics.partitions as usize, "{api}");
    eventually(Duration::from_secs(30), "the lag shown to equal the API's", || async {
        let (_, api) = running.get("/v1/overview").await;
        let shown = browser
            .js("return [...document.querySelectorAll('[data-lag]')].map(r => [r.dataset.lag, r.querySelector('.lag').textContent]);")
            .await;
        let expected: Vec<Value> = api["consumer_lag"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| json!([format!("{}/{}", l["topic"].as_str().unwrap(), l["partition"]), l["lag"].to_string()]))
            .collect();
        shown == json!(expected)
    })
    .await;
    // Refreshing keeps every tile where it was.
    let layout = "return [...document.querySelectorAll('.tile, section, table')].map(e => { const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; });";
    let before = browser.js(layout).await;
    let updated = browser.text("#updated").await;
    browser
        .until(
            "a refresh",
            &format!(
                "return document.getElementById('updated').textContent !== {};",
                json!(updated)
            ),
        )
        .await;
    browser
        .until("another refresh", "return new Promise(r => setTimeout(() => r(true), 2200));")
        .await;
    assert_eq!(browser.js(layout).await, before, "the layout moved on refresh");
    // The charts: the recorded minutes (the busiest 100 accepted a second), again after a
    // reload — they come from Postgres, not from what this page saw.
    let charts = "const n = document.getElementById('history-note'); \
                  const a = document.querySelector(\"[data-chart='accepted']\"); \
                  return n && a && Number(n.dataset.points) >= 10 && Number(a.dataset.points) >= 10 \
                      ? [n.textContent, a.title] : null;";
    let shown = browser.until("the recorded minutes charted", charts).await;
    assert!(shown[0].as_str().unwrap().contains("from 60 min ago to now"), "{shown}");
    assert!(shown[1].as_str().unwrap().contains("highest 100"), "{shown}");
    browser.screenshot("overview").await;
    browser.client.refresh().await.unwrap();
    let again = browser.until("the recorded minutes after a reload", charts).await;
    assert!(again[1].as_str().unwrap().contains("highest 100"), "{again}");

    // --- Processors: the one running, its partitions, and a slow job running in it. ---
    let slow =
        index_job("doc-slow", 1, json!({ "text": "slow", "simulate": { "sleep_ms": 6000 } }));
    let slow = it.acceptor().await.accept(&it.pool, &slow).await.unwrap().job_id;
    browser.goto(&format!("{ui}#/processors")).await;
    let shown = browser
        .until(
            "the slow job running in the processor",
            &format!(
                "const row = document.querySelector(\"tr[data-running='{slow}']\"); \
                 const p = row && row.closest('[data-processor]'); \
                 return p ? [p.dataset.alive, p.querySelector('[data-partitions]').dataset.partitions, \
                             p.querySelector('[data-in-flight]').dataset.inFlight] : null;"
            ),
        )
        .await;
    let all: Vec<String> = (0..it.config.topics.partitions).map(|p| p.to_string()).collect();
    assert_eq!(shown, json!(["yes", all.join(","), "1"]), "the processor as it is");
    let (_, listed) = running.get("/v1/processors").await;
    assert_eq!(listed["processors"].as_array().unwrap().len(), 1, "{listed}");
    browser.screenshot("processors").await;
    eventually(Duration::from_secs(60), "the slow job to end", || async {
        state(&it, slow).await == "succeeded"
    })
    .await;

    // --- Keyboard: from the top of the page to the jobs search. ---
    browser
        .js("document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0);")
        .await;
    let mut reached = false;
    for _ in 0..12 {
        browser.press(Key::Tab.into()).await;
        if browser.js("return document.activeElement.dataset.nav === 'jobs';").await == json!(true)
        {
            reached = true;
            break;
        }
    }
    assert!(reached, "the Jobs link is not reachable with Tab");
    browser.press(Key::Enter.into()).await;
    browser
        .until(
            "the jobs page",
            "return location.hash === '#/jobs' && document.querySelector('input[name=q]');",
        )
        .await;

    // --- Search: by document, then by id. ---
    browser.fill("input[name=q]", "doc-ok-3").await;
    browser.press(Key::Enter.into()).await;
    let found = browser
        .until("the search result", "const rows = document.querySelectorAll('tr[data-job]'); return location.hash.includes('doc-ok-3') && rows.length ? [...rows].map(r => r.dataset.job) : null;")
        .await;
    assert_eq!(found, json!([seeded.ok[3].to_string()]));
    browser.screenshot("jobs").await;
    browser.click("tr[data-job] a").await;
    browser
        .until(
            "the job's events",
            "const rows = [...document.querySelectorAll('tr[data-event]')]; \
             return rows.length > 0 && rows[rows.length - 1].dataset.event === 'JobSucceeded';",
        )
        .await;
    let events = browser
        .js("return [...document.querySelectorAll('tr[data-event]')].map(r => r.dataset.event);")
        .await;
    // The lease is an event of its own, or said by the success of a run that ended inside
    // its lease transaction: the page shows the log as it is.
    let logged: Vec<String> =
        sqlx::query_scalar("SELECT kind FROM job_events WHERE job_id = $1 ORDER BY stream_version")
            .bind(seeded.ok[3])
            .fetch_all(&it.pool)
            .await
            .unwrap();
    assert_eq!(events, json!(logged));
    assert!(
        events == json!(["JobRequested", "JobLeased", "JobSucceeded"])
            || events == json!(["JobRequested", "JobSucceeded"]),
        "{events}"
    );
    if events == json!(["JobRequested", "JobSucceeded"]) {
        let said = browser
            .js("return document.querySelector('tr[data-event=JobSucceeded] td.details').textContent;")
            .await;
        assert!(said.as_str().is_some_and(|s| s.contains("leased by")), "{said}");
    }
    assert_eq!(browser.text("#job-state [data-state]").await, "succeeded");
    // The input and the result load after the page, each by a request of its own.
    browser
        .until(
            "the input and the result",
            "const text = (id) => document.getElementById(id)?.textContent || ''; \
             return text('input-text').includes('hello number 3') && text('result-text').includes('terms');",
        )
        .await;
    browser.screenshot("job").await;

    browser.goto(&format!("{ui}#/jobs")).await;
    browser.fill("input[name=q]", &seeded.html.to_string()).await;
    browser.click("#job-search button[type=submit]").await;
    browser
        .until("the job page", &format!("return location.hash === '#/jobs/{}';", seeded.html))
        .await;

    // --- User data is text: the HTML job's page, its listing and its dead letter. ---
    browser.until("the summary", "return document.querySelector('#job-summary .doc');").await;
    assert_eq!(browser.text("#job-summary .doc").await, HTML_DOCUMENT);
    browser.until("the input", "return document.getElementById('input-text').textContent;").await;
    assert!(browser.text("#input-text").await.contains(HTML_TEXT), "the input as text");
    assert_eq!(browser.js(INJECTED).await, json!({ "pwned": null, "elements": 0 }));
    browser.screenshot("job-html-input").await;
    browser.click("#job-summary .doc").await;
    browser
        .until(
            "the document's jobs",
            "return document.querySelectorAll('tr[data-job]').length === 1;",
        )
        .await;
    assert_eq!(browser.text("tr[data-job] .doc").await, HTML_DOCUMENT);
    assert_eq!(browser.js(INJECTED).await, json!({ "pwned": null, "elements": 0 }));

    // --- Hidden characters shown as what they are; the trace a link. ---
    browser.goto(&format!("{ui}#/jobs/{}", seeded.bidi)).await;
    browser.until("the summary", "return document.querySelector('#job-summary .doc');").await;
    assert_eq!(browser.text("#job-summary .doc").await, BIDI_SHOWN);
    let link = browser
        .until(
            "the trace link",
            "const a = document.querySelector('a[data-field=trace_id]'); return a && a.href;",
        )
        .await;
    assert_eq!(link, json!(TRACE_URL.replace("{trace_id}", TRACE_ID)));
    browser.goto(&format!("{ui}#/jobs?document_id={}", urlencoding(BIDI_DOCUMENT))).await;
    let listed = browser
        .until(
            "the listing",
            "const d = document.querySelector('tr[data-job] .doc'); return d && d.textContent;",
        )
        .await;
    assert_eq!(listed, json!(BIDI_SHOWN));

    // --- A large result: a preview and a download of the whole. ---
    browser.goto(&format!("{ui}#/jobs/{}", seeded.large)).await;
    let note = browser
        .until("the result's note", "return document.getElementById('result-note').textContent;")
        .await;
    assert!(note.as_str().unwrap().contains("Showing the first 4,096"), "{note}");
    // Saved from what the page read with its token (a plain link would go without it).
    let chars = browser
        .until(
            "the download",
            "const a = document.getElementById('result-download'); \
             return a && !a.hidden && a.href.startsWith('blob:') ? Number(a.dataset.chars) : null;",
        )
        .await;
    assert!(chars.as_i64().unwrap() >= 9000, "the download holds the whole result: {chars}");
    let download = http_client()
        .get(running.url(&format!("/v1/jobs/{}/result?download=true", seeded.large)))
        .bearer_auth(READ_TOKEN)
        .send()
        .await
        .unwrap();
    let disposition = download.headers()["content-disposition"].to_str().unwrap().to_owned();
    assert!(disposition.starts_with("attachment;"), "{disposition}");
    let whole: Value = download.json().await.unwrap();
    assert!(
        whole["padding"].as_str().unwrap().len() >= 9000,
        "the download holds the whole result"
    );

    // --- Changes by role: a read token is offered none and refused one; a wrong token is
    //     refused; an operator replays, once. ---
    let target = seeded.quarantined[0];
    browser.goto(&format!("{ui}#/jobs/{target}")).await;
    browser.until("the replay button", "return document.getElementById('replay');").await;
    assert!(!rendered(&browser, "#replay").await, "a read token is offered a replay");
    // The error once in the summary (the quarantine reason holds it), the quarantine's row
    // pointing at the failure above it; no empty box where no result is.
    browser
        .until(
            "the timeline",
            "return document.querySelector(\"tr[data-event='JobQuarantined']\");",
        )
        .await;
    let terms = browser
        .js("return [...document.querySelectorAll('#job-summary dt')].map(d => d.textContent);")
        .await;
    assert!(!terms.as_array().unwrap().contains(&json!("Last error")), "{terms}");
    assert!(terms.as_array().unwrap().contains(&json!("Quarantined because")), "{terms}");
    // A permanent failure is a definite one: the next attempt (a replay's) is told `failed`.
    assert_eq!(browser.text("[data-field=previous_outcome]").await, "failed");
    let quarantined_row = browser.text("tr[data-event='JobQuarantined'] .details").await;
    assert!(quarantined_row.contains("(the failure above)"), "{quarantined_row}");
    browser
        .until(
            "the result's note",
            "return document.getElementById('result-note').textContent === 'No result committed.';",
        )
        .await;
    assert!(!rendered(&browser, "#result-text").await, "an empty box under No result committed");
    assert!(!rendered(&browser, "#cancel").await, "a read token is offered a cancel");
    let refused = http_client()
        .post(running.url(&format!("/v1/jobs/{target}/replay")))
        .bearer_auth(READ_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403, "a read token's replay");
    assert_eq!(state(&it, target).await, "quarantined", "nothing changed with a read token");
    browser.click("#sign-out").await;
    browser.until("the sign-in form", "return !document.getElementById('login').hidden;").await;
    assert_eq!(browser.text("#session-state").await, "Signed out");
    browser.fill("#login-token", "not-the-token-but-long-enough").await;
    browser.click("#login-form button[type=submit]").await;
    browser.until("the wrong token refused", "return document.getElementById('login-error').textContent === 'That is not a token of this processor.';").await;
    // An upstream service's token (submit) reads, and is offered no change either.
    sign_in(&browser, SUBMIT_TOKEN, "upstream (submit)").await;
    browser
        .until(
            "the job's page again",
            "return document.querySelector(\"tr[data-event='JobQuarantined']\");",
        )
        .await;
    assert!(!rendered(&browser, "#replay").await, "a submit token is offered a replay");
    browser.click("#sign-out").await;
    sign_in(&browser, OPERATE_TOKEN, "oncall (operate)").await;
    browser
        .until(
            "the replay offered",
            "const b = document.getElementById('replay'); return b && b.getClientRects().length;",
        )
        .await;
    let url = browser.client.current_url().await.unwrap();
    assert!(!url.as_str().contains(OPERATE_TOKEN), "the token is in the URL: {url}");
    assert_eq!(browser.js("return document.cookie;").await, json!(""), "no cookie holds it");
    browser.screenshot("job-quarantined").await;
    browser.click("#replay").await;
    browser.until("the replayed job to succeed on its page", "const s = document.querySelector('#job-state [data-state]'); return s && s.dataset.state === 'succeeded';").await;
    assert_eq!(state(&it, target).await, "succeeded");
    assert_eq!(writes(&it, target).await, 1, "one business write");
    let kinds = browser
        .js("return [...document.querySelectorAll('tr[data-event]')].map(r => r.dataset.event);")
        .await;
    assert!(kinds.as_array().unwrap().contains(&json!("ReplayRequested")), "{kinds}");

    // --- Bulk replay: counted first, then confirmed. ---
    browser.goto(&format!("{ui}#/quarantine?reason=until%20replayed")).await;
    browser
        .until(
            "the two still quarantined",
            "return document.querySelectorAll('tr[data-job]').length === 2;",
        )
        .await;
    // Grouped by reason: the two share one, and its group replays them.
    let groups = browser
        .until(
            "the groups",
            "const rows = [...document.querySelectorAll('tr[data-group]')]; \
             return rows.length ? rows.map(r => r.dataset.groupJobs) : null;",
        )
        .await;
    assert_eq!(groups, json!(["2"]));
    browser.screenshot("quarantine").await;
    browser.click("[data-replay-group='0']").await;
    let matched = browser
        .until(
            "the count",
            "const m = document.getElementById('bulk-matched'); return m && m.dataset.matched;",
        )
        .await;
    assert_eq!(matched, json!("2"));
    for id in &seeded.quarantined[1..] {
        assert_eq!(state(&it, *id).await, "quarantined", "counting replays nothing");
    }
    browser.click("#bulk-yes").await;
    for id in &seeded.quarantined[1..] {
        let id = *id;
        eventually(Duration::from_secs(60), "a bulk-replayed job to succeed", || async {
            state(&it, id).await == "succeeded"
        })
        .await;
        assert_eq!(writes(&it, id).await, 1);
    }

    // --- Cancel: a job scheduled for later, from its page, once confirmed. ---
    let mut later = index_job("doc-later", 1, json!({ "text": "not yet" }));
    later.run_at = Some(Utc::now() + chrono::Duration::hours(1));
    let later = it.acceptor().await.accept(&it.pool, &later).await.unwrap().job_id;
    browser.goto(&format!("{ui}#/jobs/{later}")).await;
    browser.until("the cancel button", "return document.getElementById('cancel');").await;
    assert!(browser.text("#job-summary").await.contains("Due"), "the due time is shown");
    browser.click("#cancel").await;
    browser
        .until(
            "the question",
            "return !document.getElementById('cancel-yes').closest('.ask').hidden;",
        )
        .await;
    assert_eq!(state(&it, later).await, "queued", "asking cancels nothing");
    browser.click("#cancel-yes").await;
    browser
        .until(
            "the job cancelled on its page",
            "const s = document.querySelector('#job-state [data-state]'); return s && s.dataset.state === 'cancelled';",
        )
        .await;
    assert_eq!(state(&it, later).await, "cancelled");

    // --- Run now: a job scheduled for later, brought forward from its page. ---
    let mut soon = index_job("doc-soon", 1, json!({ "text": "now, please" }));
    soon.run_at = Some(Utc::now() + chrono::Duration::hours(1));
    let soon = it.acceptor().await.accept(&it.pool, &soon).await.unwrap().job_id;
    // From the Scheduled list: what waits for a time, each with its own run-now.
    browser.goto(&format!("{ui}#/jobs?scheduled=true")).await;
    let listed = browser
        .until(
            "the scheduled list",
            "const rows = [...document.querySelectorAll('tr[data-job]')]; \
             return rows.length ? rows.map(r => r.dataset.job) : null;",
        )
        .await;
    assert_eq!(listed, json!([soon.to_string()]), "only the job due later");
    browser.click(&format!("[data-run-now='{soon}']")).await;
    eventually(Duration::from_secs(60), "the job brought forward to run", || async {
        state(&it, soon).await == "succeeded"
    })
    .await;
    assert_eq!(writes(&it, soon).await, 1);

    // --- Bulk cancel from the jobs list: counted first, then confirmed. ---
    for n in 0..3 {
        let mut held = index_job(&format!("doc-bulk-{n}"), 1, json!({ "text": "not yet" }));
        held.run_at = Some(Utc::now() + chrono::Duration::hours(1));
        it.acceptor().await.accept(&it.pool, &held).await.unwrap();
    }
    browser.goto(&format!("{ui}#/jobs?kind=index-document&state=queued")).await;
    browser.until("the bulk cancel", "return document.getElementById('cancel-count');").await;
    browser.click("#cancel-count").await;
    let matched = browser
        .until(
            "the count",
            "const m = document.getElementById('cancel-matched'); return m && m.dataset.matched;",
        )
        .await;
    assert_eq!(matched, json!("3"));
    let open = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM jobs WHERE document_id LIKE 'doc-bulk-%' AND state = 'queued'",
        )
        .fetch_one(&it.pool)
        .await
        .unwrap()
    };
    assert_eq!(open().await, 3, "counting cancels nothing");
    browser.click("#cancel-all-yes").await;
    eventually(Duration::from_secs(30), "the three cancelled", || async { open().await == 0 })
        .await;

    // --- Kinds: paused with a reason, its job waiting unleased, then resumed. ---
    browser.goto(&format!("{ui}#/kinds")).await;
    browser
        .until("the kinds", "return document.querySelector(\"[data-pause='index-document']\");")
        .await;
    browser.fill("[data-reason='index-document']", "the index is rebuilt").await;
    browser.click("[data-pause='index-document']").await;
    browser
        .until(
            "the kind shown paused",
            "const s = document.querySelector(\"tr[data-kind='index-document'] [data-kind-state]\"); return s && s.dataset.kindState === 'paused';",
        )
        .await;
    let (by, reason): (String, Option<String>) =
        sqlx::query_as("SELECT paused_by, reason FROM kind_pauses WHERE kind = 'index-document'")
            .fetch_one(&it.pool)
            .await
            .unwrap();
    // Requested by the token's name, whatever the page says.
    assert_eq!((by.as_str(), reason.as_deref()), ("oncall", Some("the index is rebuilt")));
    eventually(Duration::from_secs(30), "the processor to hold the kind paused", || async {
        let text = running.processor.scrape().await.unwrap_or_default();
        metric_value(&text, "jobfold_kind_paused", &[("kind", "index-document")]) == Some(1.0)
    })
    .await;
    let held = index_job("doc-held", 1, json!({ "text": "held" }));
    let held = it.acceptor().await.accept(&it.pool, &held).await.unwrap().job_id;
    browser
        .until(
            "the held job counted as waiting",
            "const w = document.querySelector(\"tr[data-kind='index-document'] [data-waiting]\"); return w && w.dataset.waiting === '1';",
        )
        .await;
    assert_eq!(state(&it, held).await, "queued", "a paused kind's job is not leased");
    browser.screenshot("kinds-paused").await;
    browser.click("[data-resume='index-document']").await;
    // The resume dispatches what waited; a reaper round that runs between its commit and its
    // dispatch takes the held job first (each skips what the other locked), and the resume
    // then counts it not: the answer says how many this request dispatched, and the held
    // job must run once either way.
    browser
        .until(
            "the resume answer",
            "const t = document.getElementById('toast').textContent; return /Resumed index-document: [01] waiting jobs? dispatched again\\./.test(t);",
        )
        .await;
    eventually(Duration::from_secs(60), "the held job to run once resumed", || async {
        state(&it, held).await == "succeeded"
    })
    .await;
    assert_eq!(writes(&it, held).await, 1);

    // --- Kinds: each kind's open jobs, last hour and times; a kind's own page. ---
    browser.goto(&format!("{ui}#/kinds")).await;
    let row = browser
        .until(
            "the recorded kind's figures",
            "const r = document.querySelector(\"tr[data-kind='seeded-kind']\"); \
             return r && ['succeeded', 'failed', 'quarantined', 'wait', 'run'] \
                 .map(k => r.querySelector(`[data-${k}]`).dataset[k]);",
        )
        .await;
    assert_eq!(row, json!(["47", "2", "1", "50/50", "250/5000"]), "as recorded");
    browser
        .until(
            "the resume's note gone",
            "const t = document.getElementById('toast'); return !t.classList.contains('shown') && getComputedStyle(t).opacity === '0';",
        )
        .await;
    browser.screenshot("kinds").await;
    browser.click("tr[data-kind='seeded-kind'] a").await;
    let page = browser
        .until(
            "the kind's page",
            "const c = document.getElementById('kind-chart'); \
             const s = document.querySelector('#kind-ended [data-succeeded]'); \
             return c && s && c.dataset.points ? [c.dataset.points, s.textContent, \
                 document.querySelector('#kind-ended [data-run]').textContent, \
                 c.querySelectorAll('rect').length] : null;",
        )
        .await;
    assert_eq!(page, json!(["2", "47", "≤ 250 ms / ≤ 5.0 s", 3]), "two minutes, three bars");
    browser.screenshot("kind").await;

    // --- Dead letters: shown as text, re-injected once its cause is fixed, deleted. ---
    browser.goto(&format!("{ui}#/dead-letters")).await;
    browser
        .until(
            "the dead letter",
            "return document.querySelectorAll('tr[data-dead-letter]').length === 1;",
        )
        .await;
    assert!(browser.text("tr[data-dead-letter] .error-text").await.contains("late-kind"));
    browser.screenshot("dead-letters").await;
    browser.click("tr[data-dead-letter] a").await;
    let value = browser.until("the value", "const v = document.querySelector('[data-field=value_text]'); return v && v.textContent;").await;
    assert!(value.as_str().unwrap().contains("doc-html"), "{value}");
    assert!(value.as_str().unwrap().contains("<script>"), "the bytes as text: {value}");
    assert_eq!(browser.js(INJECTED).await, json!({ "pwned": null, "elements": 0 }));
    browser.screenshot("dead-letter").await;
    // The fix: the kind's handler is deployed.
    sqlx::query("INSERT INTO job_kinds (kind, registered_by) VALUES ('late-kind', 'deploy')")
        .execute(&it.pool)
        .await
        .unwrap();
    browser.click("#reinject").await;
    browser
        .until(
            "the re-inject answer",
            "return document.getElementById('toast').textContent.startsWith('Sent back');",
        )
        .await;
    eventually(Duration::from_secs(60), "the re-injected request to become a job", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM jobs WHERE kind = 'late-kind' AND document_id = $1",
        )
        .bind(HTML_DOCUMENT)
        .fetch_one(&it.pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    let id = browser.js("return location.hash.split('/').pop();").await;
    // Deleting is the admin's: not offered to the operator; signed in as admin, it is.
    assert!(!rendered(&browser, "#delete").await, "an operate token is offered a delete");
    browser.click("#sign-out").await;
    sign_in(&browser, TOKEN, "api_token (admin)").await;
    browser
        .until(
            "the delete offered",
            "const b = document.getElementById('delete'); return b && b.getClientRects().length;",
        )
        .await;
    browser.click("#delete").await;
    browser.click("#delete-yes").await;
    browser.until("the list again", "return location.hash === '#/dead-letters';").await;
    let (status, _) = running.get(&format!("/v1/dead-letters/{}", id.as_str().unwrap())).await;
    assert_eq!(status, 404, "deleted");
    // In bulk: counted first, then deleted.
    for offset in [1, 2] {
        sqlx::query(
            "INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset, raw_value, error) \
             VALUES ('g', 'jobfold.events', 0, $1, '\\x00'::bytea, 'undecodable')",
        )
        .bind(offset)
        .execute(&it.pool)
        .await
        .unwrap();
    }
    // The list is shown already: read it again.
    browser.client.refresh().await.unwrap();
    browser
        .until(
            "the two letters",
            "return document.querySelectorAll('tr[data-dead-letter]').length === 2;",
        )
        .await;
    browser.click("#delete-count").await;
    let matched = browser
        .until(
            "the count",
            "const m = document.getElementById('delete-matched'); return m && m.dataset.matched;",
        )
        .await;
    assert_eq!(matched, json!("2"));
    assert_eq!(it.count("dead_letters").await, 2, "counting deletes nothing");
    browser.click("#delete-all-yes").await;
    browser
        .until(
            "the delete answer",
            "return document.getElementById('toast').textContent === 'Deleted 2 dead letters.';",
        )
        .await;
    assert_eq!(it.count("dead_letters").await, 0);

    // --- The audit trail: each change, by whom, on the page and in Postgres. ---
    browser.goto(&format!("{ui}#/audit")).await;
    let shown = browser
        .until(
            "the audit trail",
            "const rows = [...document.querySelectorAll('tr[data-audit-action]')]; \
             return rows.length >= 8 ? rows.map(r => r.dataset.auditActor + ' ' + r.dataset.auditAction) : null;",
        )
        .await;
    let shown: Vec<String> =
        shown.as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    for change in [
        "oncall replay",
        "oncall replay_matching",
        "oncall cancel",
        "oncall run_now",
        "oncall cancel_matching",
        "oncall pause_kind",
        "oncall resume_kind",
        "oncall reinject_dead_letter",
        "api_token delete_dead_letter",
        "api_token delete_dead_letters",
    ] {
        assert!(shown.iter().any(|s| s == change), "{change} not in {shown:?}");
    }
    let row: (String, Option<String>, String, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT actor, role, via, target, request_id FROM audit_log WHERE action = 'replay'",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    let (actor, role, via, target_id, request) = &row;
    assert_eq!((actor.as_str(), role.as_deref(), via.as_str()), ("oncall", Some("operate"), "api"));
    assert_eq!(target_id.as_deref(), Some(target.to_string().as_str()));
    assert!(request.as_deref().is_some_and(|r| !r.is_empty()), "the request's id is recorded");
    browser.screenshot("audit").await;

    // --- Mutations from another origin are refused, token or not. ---
    let evil = http_client()
        .post(running.url(&format!("/v1/jobs/{}/cancel", seeded.ok[0])))
        .bearer_auth(TOKEN)
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(evil.status(), 403);
    let same = http_client()
        .post(running.url("/v1/auth"))
        .bearer_auth(TOKEN)
        .header("origin", format!("http://127.0.0.1:{}", running.http))
        .send()
        .await
        .unwrap();
    assert_eq!(same.status(), 200);
    assert_eq!(same.json::<Value>().await.unwrap()["role"], "admin");
    // A page that rebound its own name to this address sends that name: answered 421.
    let rebound = http_client()
        .get(running.url("/v1/overview"))
        .bearer_auth(TOKEN)
        .header("host", "rebound.evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    let page = http_client().get(&ui).send().await.unwrap();
    let policy = page.headers()["content-security-policy"].to_str().unwrap();
    assert!(policy.contains("script-src 'self'"), "{policy}");

    // --- A phone's width: nothing wider than the screen. ---
    browser.client.set_window_size(390, 844).await.unwrap();
    browser.goto(&format!("{ui}#/")).await;
    browser
        .until(
            "the overview",
            "return document.getElementById('updated').textContent.startsWith('Updated');",
        )
        .await;
    assert!(browser.fits_width().await, "the overview is wider than a phone");
    browser.screenshot("overview-phone").await;
    browser.goto(&format!("{ui}#/jobs/{}", seeded.html)).await;
    browser
        .until(
            "the job's events",
            "const rows = [...document.querySelectorAll('tr[data-event]')]; \
             return rows.length >= 2 && rows[rows.length - 1].dataset.event === 'JobSucceeded';",
        )
        .await;
    assert!(browser.fits_width().await, "the job page is wider than a phone");
    browser.screenshot("job-phone").await;
    let letter: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (consumer_group, topic, kafka_partition, kafka_offset, raw_value, error) \
         VALUES ('g', 'jobfold.events', 0, 3, '\\x00'::bytea, 'undecodable') RETURNING id",
    )
    .fetch_one(&it.pool)
    .await
    .unwrap();
    let letter_page = format!("#/dead-letters/{letter}");
    for (page, name, ready) in [
        (letter_page.as_str(), "dead-letter", "[data-field=value_text]"),
        ("#/jobs", "jobs", "tr[data-job]"),
        ("#/processors", "processors", "[data-processor]"),
        ("#/kinds", "kinds", "tr[data-kind='seeded-kind']"),
        ("#/kinds/seeded-kind", "kind", "#kind-chart[data-points]"),
        ("#/quarantine", "quarantine", "main tbody tr"),
        ("#/dead-letters", "dead-letters", "main tbody tr"),
        ("#/audit", "audit", "tr[data-audit-action]"),
    ] {
        browser.goto(&format!("{ui}{page}")).await;
        browser
            .until(
                &format!("the {name} page"),
                &format!("return document.querySelector({});", json!(ready)),
            )
            .await;
        assert!(browser.fits_width().await, "the {name} page is wider than a phone");
        browser.screenshot(&format!("{name}-phone")).await;
    }

    browser.close().await;
    it.cleanup().await;
}

/// The overview's Postgres figures do not depend on Kafka: with no broker answering, it still
/// answers 200 with them, and says why the lag is missing.
#[tokio::test(flavor = "multi_thread")]
async fn the_overview_answers_with_kafka_down() {
    let mut it = Installation::new("console-no-kafka").await;
    // Nothing listens there.
    it.config.kafka_brokers = format!("127.0.0.1:{}", jobfold_tests::harness::free_port());
    let acceptor = it.acceptor().await;
    acceptor.accept(&it.pool, &index_job("doc-waiting", 1, json!({ "text": "a" }))).await.unwrap();
    let app = jobfold_processor::http::router(it.api_state().await, 64 * 1024);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    // The second comes while the first reading still waits for the brokers.
    for _ in 0..2 {
        let response = http_client().get(format!("{base}/v1/overview")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        let overview: Value = response.json().await.unwrap();
        assert_eq!(overview["unfinished"], 1, "{overview}");
        assert_eq!(overview["jobs"]["queued"], 1, "{overview}");
        assert_eq!(overview["consumer_lag"], json!([]), "{overview}");
        let why = overview["consumer_lag_error"].as_str().unwrap();
        assert!(why.contains("Kafka"), "{why}");
    }
    it.config.kafka_brokers = jobfold_tests::services::kafka_brokers();
    it.cleanup().await;
}
