//! A private jobfold installation per test: its own database, topics, consumer groups and
//! relay lock, so tests run in parallel against one Postgres and one broker; and jobfold's
//! binaries started as OS processes that a test can kill.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use jobfold_common::accept::{Acceptor, NewJob};
use jobfold_common::config::{Config, Sensitive};
use jobfold_schemas::{Codec, Decoder, JobEvent};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use sqlx::PgPool;
use uuid::Uuid;

use crate::kafka::unique_name;
use crate::services;

/// How every test database's name starts (`jobfold-test-sweep` finds leftovers by it).
pub const SCRATCH_DATABASE: &str = "jobfold_test_";

/// One test's jobfold: a fresh database with the migrations applied, and unique names.
#[derive(Debug)]
pub struct Installation {
    pub config: Config,
    pub pool: PgPool,
    database: String,
    /// Where the database was made, and is dropped.
    admin_url: String,
}

impl Installation {
    /// Creates the database and applies the migrations; creates no topics yet.
    pub async fn new(name: &str) -> Self {
        services::require_all();
        Self::on(name, &services::database_url(), |url| url.to_owned()).await
    }

    /// [`Installation::new`] on the Postgres of `admin_url` (a database of it, any): the
    /// database is made there, and the binaries reach it by `url_for(that database's URL)`
    /// (the URL naming a pair's both hosts).
    pub async fn on(name: &str, admin_url: &str, url_for: impl Fn(&str) -> String) -> Self {
        let admin_url = admin_url.to_owned();
        let admin = PgPool::connect(&admin_url).await.expect("connecting to Postgres");
        // The random part first: Postgres cuts names at 63 bytes, and a long test name must
        // lose its tail, not the part that makes the name unique.
        let database =
            format!("{SCRATCH_DATABASE}{}_{}", Uuid::new_v4().simple(), name.replace('-', "_"));
        jobfold_common::db::create_database(&admin, &database).await.unwrap();
        admin.close().await;
        let (base, _) = admin_url.rsplit_once('/').unwrap();
        let url = url_for(&format!("{base}/{database}"));

        let mut config = Config::load(None).expect("the compiled-in defaults load");
        config.database_url = Sensitive::new(url);
        config.kafka_brokers = services::kafka_brokers();
        config.schema_registry_url =
            jobfold_common::config::SecretUrl::new(services::schema_registry_url());
        config.topics.events = unique_name(&format!("{name}-events"));
        config.topics.requests = unique_name(&format!("{name}-requests"));
        config.intake.group = unique_name(&format!("{name}-intake"));
        config.relay.lock_key = i64::from(rand::random::<u32>());
        config.relay.standby_retry = Duration::from_millis(200);
        config.relay.poll_interval = Duration::from_millis(500);
        config.http_addr = "127.0.0.1:0".parse().unwrap();
        config.metrics_addr = "127.0.0.1:0".parse().unwrap();
        let pool = jobfold_common::db::connect(&config, 20).await.unwrap();
        crate::handlers::migrate(&pool).await.unwrap();
        // As if the test processor had run once: its kind is accepted before one starts.
        jobfold_processor::handler::register(&crate::handlers::handlers(), &pool, "test")
            .await
            .unwrap();
        Self { config, pool, database, admin_url }
    }

    /// Test timings in `config`: short leases and retries, quick reaper rounds, a consumer
    /// group of its own (as [`Installation::fast_env`] gives binaries).
    pub fn fast(&mut self) {
        let p = &mut self.config.processor;
        p.lease_ttl = Duration::from_secs(3);
        p.heartbeat = Duration::from_secs(1);
        p.retry_base = Duration::from_millis(50);
        p.retry_cap = Duration::from_millis(200);
        p.reaper_interval = Duration::from_millis(500);
        p.reaper_grace = Duration::from_secs(2);
        p.revoke_timeout = Duration::from_secs(5);
        p.shutdown_timeout = Duration::from_secs(2);
        p.group = unique_name("processors");
    }

    /// Creates this installation's topics.
    pub async fn create_topics(&self) {
        jobfold_common::kafka::ensure_topics(
            &self.config,
            &jobfold_common::kafka::jobfold_topics(&self.config),
        )
        .await
        .unwrap();
    }

    /// An acceptor writing to this installation (registers the schema).
    pub async fn acceptor(&self) -> Acceptor {
        let codec =
            Codec::<JobEvent>::connect(self.registry(), &self.config.topics.events).await.unwrap();
        Acceptor::new(codec, self.config.accept_policy(), "test")
    }

    /// An event appender writing to this installation (registers the schema).
    pub async fn events(&self) -> jobfold_processor::store::Events {
        let codec =
            Codec::<JobEvent>::connect(self.registry(), &self.config.topics.events).await.unwrap();
        jobfold_processor::store::Events {
            codec,
            topic: self.config.topics.events.clone(),
            producer: "test".into(),
        }
    }

    /// The HTTP API's state for this installation.
    pub async fn api_state(&self) -> jobfold_processor::http::ApiState {
        jobfold_processor::http::ApiState::new(
            self.pool.clone(),
            self.acceptor().await,
            self.events().await,
            self.config.clone(),
        )
    }

    pub fn registry(&self) -> schema_registry_converter::async_impl::schema_registry::SrSettings {
        self.config.registry().unwrap()
    }

    /// `JOBFOLD_*` variables that make a binary use this installation.
    pub fn env(&self) -> HashMap<String, String> {
        let c = &self.config;
        HashMap::from([
            ("JOBFOLD_DATABASE_URL".into(), c.database_url.expose().clone()),
            ("JOBFOLD_KAFKA_BROKERS".into(), c.kafka_brokers.clone()),
            ("JOBFOLD_SCHEMA_REGISTRY_URL".into(), c.schema_registry_url.expose().to_owned()),
            ("JOBFOLD_TOPICS__EVENTS".into(), c.topics.events.clone()),
            ("JOBFOLD_TOPICS__REQUESTS".into(), c.topics.requests.clone()),
            ("JOBFOLD_INTAKE__GROUP".into(), c.intake.group.clone()),
            ("JOBFOLD_RELAY__LOCK_KEY".into(), c.relay.lock_key.to_string()),
            ("JOBFOLD_RELAY__STANDBY_RETRY".into(), "200ms".into()),
            ("JOBFOLD_RELAY__POLL_INTERVAL".into(), "500ms".into()),
            ("JOBFOLD_HTTP_ADDR".into(), "127.0.0.1:0".into()),
            ("JOBFOLD_METRICS_ADDR".into(), format!("127.0.0.1:{}", free_port())),
        ])
    }

    /// [`Installation::env`] with test timings (short leases, heartbeats, retries and reaper
    /// rounds; a killed member's partitions move after 6 s) and the processors' `group`.
    pub fn fast_env(&self, group: &str) -> HashMap<String, String> {
        let mut env = self.env();
        for (k, v) in [
            ("JOBFOLD_PROCESSOR__LEASE_TTL", "3s"),
            ("JOBFOLD_PROCESSOR__HEARTBEAT", "1s"),
            ("JOBFOLD_PROCESSOR__RETRY_BASE", "50ms"),
            ("JOBFOLD_PROCESSOR__RETRY_CAP", "200ms"),
            ("JOBFOLD_PROCESSOR__REAPER_INTERVAL", "500ms"),
            ("JOBFOLD_PROCESSOR__REAPER_GRACE", "2s"),
            ("JOBFOLD_PROCESSOR__REVOKE_TIMEOUT", "5s"),
            ("JOBFOLD_PROCESSOR__SHUTDOWN_TIMEOUT", "2s"),
            // The broker's minimum session timeout, not 45 s.
            ("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS", "6000"),
        ] {
            env.insert(k.into(), v.into());
        }
        env.insert("JOBFOLD_PROCESSOR__GROUP".into(), group.to_owned());
        env
    }

    /// Row count of `table`.
    pub async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// A job's state and attempt count.
    pub async fn state_and_attempt(&self, job_id: Uuid) -> (String, i32) {
        sqlx::query_as("SELECT state::text, attempt FROM jobs WHERE job_id = $1")
            .bind(job_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Events the relay has not published yet.
    pub async fn unpublished(&self) -> i64 {
        jobfold_common::gauges::unpublished(&self.pool).await.unwrap()
    }

    /// Has the relay publish the last `count` events of the log again, as after a crash
    /// between producing them and moving its cursor.
    pub async fn republish_last(&self, count: i64) {
        let mut conn = self.pool.acquire().await.unwrap();
        jobfold_relay::log::rewind(&mut conn, count).await.unwrap();
    }

    /// Makes Postgres refuse every job row of `document` (SQLSTATE 23514): a data error about
    /// one request's row, for tests of what such an error costs.
    pub async fn refuse_document(&self, document: &str) {
        sqlx::query(&format!(
            "ALTER TABLE jobs ADD CONSTRAINT test_refused CHECK (document_id <> '{document}')"
        ))
        .execute(&self.pool)
        .await
        .unwrap();
    }

    /// A relay and `processors` processors of this installation, their consumer group named
    /// after `name`, with the kinds in `kinds` (TOML, written to a file of its own); each
    /// processor serves its API on a port of its own. Returned once every processor holds
    /// partitions.
    pub async fn start_group(&self, name: &str, kinds: &str, processors: usize) -> Group {
        let file =
            std::env::temp_dir().join(format!("jobfold-{name}-{}.toml", Uuid::new_v4().simple()));
        std::fs::write(&file, kinds).unwrap();
        let mut env = self.fast_env(&crate::kafka::unique_name(name));
        env.insert("JOBFOLD_CONFIG".into(), file.display().to_string());
        let relay = Service::start("jobfold-relay", &env);
        let mut group = Group { relay, processors: Vec::new(), http: Vec::new(), file };
        for _ in 0..processors {
            let http = free_port();
            env.insert("JOBFOLD_HTTP_ADDR".into(), format!("127.0.0.1:{http}"));
            group.processors.push(Service::start("jobfold-processor", &env));
            group.http.push(http);
        }
        for processor in &group.processors {
            eventually(Duration::from_secs(90), "each processor to hold partitions", || async {
                processor.metric("jobfold_assigned_partitions").await.unwrap_or(0.0) > 0.0
            })
            .await;
        }
        group
    }

    /// Drops the database and deletes the topics (call at the end of a passing test; what a
    /// failing one leaves, `jobfold-test-sweep` removes after the run).
    pub async fn cleanup(self) {
        let topics = [self.config.topics.events.as_str(), self.config.topics.requests.as_str()];
        if let Err(e) = jobfold_common::kafka::delete_topics(&self.config, &topics).await {
            tracing::warn!("leaving this test's topics: {e:#}");
        }
        self.pool.close().await;
        let admin = PgPool::connect(&self.admin_url).await.unwrap();
        let _ = jobfold_common::db::drop_database(&admin, &self.database).await;
    }
}

/// What [`Installation::start_group`] started; its configuration file goes with it.
#[derive(Debug)]
pub struct Group {
    pub relay: Service,
    pub processors: Vec<Service>,
    /// Each processor's API port.
    pub http: Vec<u16>,
    file: PathBuf,
}

impl Group {
    /// The first processor.
    pub fn processor(&self) -> &Service {
        &self.processors[0]
    }

    /// `path` on the first processor's API.
    pub fn api(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http[0])
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

/// An `index-document` job for `document` at `version`, without idempotency key or trace.
pub fn index_job(document: &str, version: i64, input: serde_json::Value) -> NewJob {
    NewJob {
        document_id: document.into(),
        kind: "index-document".into(),
        input_version: version,
        input,
        idempotency_key: None,
        trace: None,
        run_at: None,
    }
}

/// A free TCP port on loopback (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Release builds of the binaries the tests start, in place of debug ones; set once, before
/// the first is started ([`use_release_builds`]).
static RELEASE: OnceLock<bool> = OnceLock::new();

/// Has every binary the tests start ([`binary`], [`Service::start`]) built and run in the
/// release profile: the product as it ships, for long runs whose delays should measure the
/// faults rather than a debug build's CPU. The tests themselves run debug builds.
///
/// # Panics
/// A binary was started already, in the debug profile.
pub fn use_release_builds() {
    assert!(
        *RELEASE.get_or_init(|| true),
        "release builds asked for after a debug binary was started"
    );
}

/// `release` or `debug`: the profile the started binaries are built in.
pub fn profile() -> &'static str {
    if *RELEASE.get_or_init(|| false) { "release" } else { "debug" }
}

/// Where cargo puts this workspace's binaries, in [`profile`].
fn target_dir() -> PathBuf {
    let target = match std::env::var("CARGO_TARGET_DIR") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
    };
    target.join(profile())
}

/// The `jobfold` command line, pointed at the test services.
pub fn jobfold_cli() -> Command {
    crate::services::require_all();
    let mut command = Command::new(binary("jobfold"));
    command
        .env("JOBFOLD_DATABASE_URL", crate::services::database_url())
        .env("JOBFOLD_KAFKA_BROKERS", crate::services::kafka_brokers())
        .env("JOBFOLD_SCHEMA_REGISTRY_URL", crate::services::schema_registry_url());
    command
}

/// The path of a workspace binary, built first (once per test process) so it is current.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // The whole workspace, as docker/test.sh builds it: the same package set resolves the
        // same features, so this finds everything built.
        let release = (profile() == "release").then_some("--release");
        let status = Command::new(cargo)
            .args(["build", "--quiet", "--workspace", "--bins"])
            .args(release)
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building the jobfold binaries failed");
    });
    let path = target_dir().join(name);
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// A relay and a test processor for one installation, the processor's HTTP API on a port of
/// its own behind an API token.
#[derive(Debug)]
pub struct Running {
    _relay: Service,
    pub processor: Service,
    /// The processor's binary.
    binary: &'static str,
    env: HashMap<String, String>,
    pub http: u16,
    token: String,
}

impl Running {
    /// Starts them with the test timings ([`Installation::fast_env`]) and `extra` variables.
    pub fn start(it: &Installation, token: &str, extra: &[(&str, &str)]) -> Self {
        Self::start_with("jobfold-test-processor", it, token, extra)
    }

    /// [`Running::start`] with `jobfold-examples` (the design's jobs and `noop`) as the
    /// processor.
    pub fn start_examples(it: &Installation, token: &str, extra: &[(&str, &str)]) -> Self {
        Self::start_with("jobfold-examples", it, token, extra)
    }

    fn start_with(
        binary: &'static str,
        it: &Installation,
        token: &str,
        extra: &[(&str, &str)],
    ) -> Self {
        let mut env = it.fast_env(&it.config.processor.group);
        env.insert("JOBFOLD_API_TOKEN".into(), token.into());
        env.insert("JOBFOLD_HTTP__TOKENS".into(), role_tokens());
        for (k, v) in extra {
            env.insert((*k).into(), (*v).into());
        }
        let http = free_port();
        env.insert("JOBFOLD_HTTP_ADDR".into(), format!("127.0.0.1:{http}"));
        let relay = Service::start("jobfold-relay", &env);
        let processor = Service::start(binary, &env);
        Self { _relay: relay, processor, binary, env, http, token: token.into() }
    }

    /// Kills the processor with SIGKILL and starts another on the same port.
    pub fn restart_processor(&mut self) {
        self.processor.kill9();
        self.processor = Service::start(self.binary, &self.env);
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    /// POSTs `body` with the token; the status and the JSON answer.
    pub async fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        let answer = http_client()
            .post(self.url(path))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = answer.status().as_u16();
        (status, answer.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// GETs `path` with the token; the status and the JSON answer.
    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let answer =
            http_client().get(self.url(path)).bearer_auth(&self.token).send().await.unwrap();
        let status = answer.status().as_u16();
        (status, answer.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// Waits until the HTTP API answers.
    pub async fn ready(&self) {
        eventually(Duration::from_secs(60), "the HTTP API to answer", || async {
            http_client()
                .get(self.url("/readyz"))
                .send()
                .await
                .is_ok_and(|a| a.status().is_success())
        })
        .await;
    }
}

/// Secrets of the tokens a [`Running`] processor takes besides its admin token, by role.
pub const READ_TOKEN: &str = "jf_test_read_0123456789abcdef";
pub const SUBMIT_TOKEN: &str = "jf_test_submit_0123456789abcdef";
pub const OPERATE_TOKEN: &str = "jf_test_operate_0123456789abcdef";

/// `http.tokens` as a `JOBFOLD_HTTP__TOKENS` value: `viewer` (read), `upstream` (submit),
/// `oncall` (operate), their secrets stored as SHA-256.
pub fn role_tokens() -> String {
    let entry = |name: &str, role: &str, secret: &str| {
        let digest = jobfold_processor::access::digest_hex(secret);
        format!("{{name=\"{name}\",role=\"{role}\",sha256=\"{digest}\"}}")
    };
    format!(
        "[{},{},{}]",
        entry("viewer", "read", READ_TOKEN),
        entry("upstream", "submit", SUBMIT_TOKEN),
        entry("oncall", "operate", OPERATE_TOKEN)
    )
}

/// An HTTP client for the tests (30 s time-out).
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// A jobfold binary running as a child process, its output in a log file. Killed on drop.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    child: Child,
    pub log: PathBuf,
    pub metrics_port: Option<u16>,
}

impl Service {
    /// Starts `binary` with `env` on top of the inherited environment, serving its metrics
    /// on a port of its own.
    pub fn start(binary_name: &str, env: &HashMap<String, String>) -> Self {
        let mut env = env.clone();
        env.insert("JOBFOLD_METRICS_ADDR".into(), format!("127.0.0.1:{}", free_port()));
        let log =
            std::env::temp_dir().join(format!("{binary_name}-{}.log", Uuid::new_v4().simple()));
        let file = std::fs::File::create(&log).unwrap();
        env.entry("RUST_LOG".into()).or_insert_with(|| "info".into());
        let child = Command::new(binary(binary_name))
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {binary_name}: {e}"));
        let metrics_port = env
            .get("JOBFOLD_METRICS_ADDR")
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok());
        Self { name: binary_name.to_owned(), child, log, metrics_port }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {}", self.pid());
    }

    /// Waits up to `timeout` for the process to exit; its status if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The log so far, for assertion messages.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The value of an unlabelled metric from this process's `/metrics`, if it answers.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        metric_value(&self.scrape().await?, name, &[])
    }

    /// This process's `/metrics` text, if it answers.
    pub async fn scrape(&self) -> Option<String> {
        let port = self.metrics_port?;
        reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.ok()?.text().await.ok()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `find` every 50 ms until it returns something; panics with `what` after `timeout`.
pub async fn eventually_some<T, F, Fut>(timeout: Duration, what: &str, mut find: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = find().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of metric `name` (the sample with every one of `labels`) as this test process
/// has recorded it: the parts a test runs in-process (a [`Pipeline`], a relay task) report
/// here. The recorder is installed at the first call, so call it before starting them.
pub fn metric_here(name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    static RECORDER: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    let handle = RECORDER.get_or_init(|| {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .expect("one recorder per test process")
    });
    metric_value(&handle.render(), name, labels)
}

/// The value of the sample `name` whose labels include every one of `labels`, in a
/// Prometheus text exposition.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|line| !line.starts_with('#')).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, label_text) = match series.split_once('{') {
            Some((metric, rest)) => (metric, rest.strip_suffix('}')?),
            None => (series, ""),
        };
        let matches = metric == name
            && labels
                .iter()
                .all(|(k, v)| label_text.split(',').any(|l| l == format!("{k}=\"{v}\"")));
        if matches { value.parse().ok() } else { None }
    })
}

/// Polls `check` every 50 ms until it holds; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many messages the events topic holds (the sum of its partitions' high watermarks).
pub fn events_on_topic(installation: &Installation) -> i64 {
    let consumer: StreamConsumer = crate::kafka::client_config().create().unwrap();
    let topic = &installation.config.topics.events;
    (0..installation.config.topics.partitions)
        .map(|p| {
            let (low, high) =
                consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks");
            high - low
        })
        .sum()
}

/// One event read back from the events topic.
#[derive(Debug, Clone)]
pub struct Published {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub timestamp_ms: Option<i64>,
    pub event: JobEvent,
}

/// Reads the events topic from the beginning, in a consumer group of its own, until
/// `done` says enough or `timeout` passes; returns what arrived, in arrival order.
pub async fn read_events(
    installation: &Installation,
    timeout: Duration,
    mut done: impl FnMut(&[Published]) -> bool,
) -> Vec<Published> {
    let consumer: StreamConsumer = crate::kafka::client_config()
        .set("group.id", unique_name("reader"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&installation.config.topics.events]).unwrap();
    let decoder = Decoder::<JobEvent>::new(installation.registry());
    let mut seen = Vec::new();
    let deadline = Instant::now() + timeout;
    while !done(&seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let Ok(message) = tokio::time::timeout(left, consumer.recv()).await else { break };
        let message = message.expect("reading the events topic");
        let event = decoder.decode(message.payload().unwrap()).await.expect("a valid event");
        seen.push(Published {
            partition: message.partition(),
            offset: message.offset(),
            key: String::from_utf8(message.key().unwrap().to_vec()).unwrap(),
            timestamp_ms: message.timestamp().to_millis(),
            event,
        });
    }
    seen
}

/// A `job_events.body` decoded: the framed Avro its writer appended.
pub fn logged_event(body: &[u8]) -> JobEvent {
    use jobfold_schemas::codec::{decode_body, split_frame};
    let (_, avro) = split_frame(body).unwrap();
    decode_body(0, &jobfold_schemas::event::JOB_EVENT_SCHEMA, avro).unwrap()
}

/// A lease as the log records it: a `JobLeased`, or a `JobSucceeded` that took its own lease
/// (its run ended inside its lease transaction, which wrote one event for both).
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedLease {
    pub job_id: Uuid,
    pub generation: i64,
    /// The id of the transaction that wrote it, as text.
    pub xid: String,
    /// Said by the success itself, not by a `JobLeased` of its own.
    pub with_success: bool,
    /// When it was taken (the event's own time for one written before `leased_at` was).
    pub leased_at: chrono::DateTime<chrono::Utc>,
}

/// Every lease the log records, of `job` or of every job, in each job's stream order.
pub async fn logged_leases(pool: &PgPool, job: Option<Uuid>) -> Vec<LoggedLease> {
    use jobfold_schemas::Payload;
    let rows: Vec<(Uuid, String, Vec<u8>)> = sqlx::query_as(
        "SELECT job_id, xid::text, body FROM job_events \
         WHERE kind IN ('JobLeased', 'JobSucceeded') AND ($1::uuid IS NULL OR job_id = $1) \
         ORDER BY job_id, stream_version",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .filter_map(|(job_id, xid, body)| {
            let event = logged_event(&body);
            let (generation, with_success, leased_at) = match event.payload {
                Payload::JobLeased(l) => {
                    (l.generation, false, l.leased_at.unwrap_or(event.occurred_at))
                }
                Payload::JobSucceeded(s) => (s.generation, true, s.lease?.leased_at),
                _ => return None,
            };
            Some(LoggedLease { job_id, generation, xid, with_success, leased_at })
        })
        .collect()
}

/// Folds every job's event log with the schemas crate's fold and compares the result with
/// the `jobs` projection, and each row's `result` with its logged `JobSucceeded`'s; returns
/// the differences (empty when they agree).
pub async fn fold_mismatches(installation: &Installation) -> Vec<String> {
    let rows: Vec<(Uuid, Vec<u8>)> =
        sqlx::query_as("SELECT job_id, body FROM job_events ORDER BY job_id, stream_version")
            .fetch_all(&installation.pool)
            .await
            .unwrap();
    type Projected = (String, i64, i32, i32, Option<String>, Option<serde_json::Value>);
    type Row = (Uuid, String, i64, i32, i32, Option<String>, Option<serde_json::Value>);
    let projection: HashMap<Uuid, Projected> = sqlx::query_as::<_, Row>(
        "SELECT job_id, state::text, generation, attempt, stream_version, previous_outcome, result \
         FROM jobs",
    )
    .fetch_all(&installation.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, state, generation, attempt, stream, previous, result)| {
        (id, (state, generation, attempt, stream, previous, result))
    })
    .collect();
    let mut streams: HashMap<Uuid, Vec<JobEvent>> = HashMap::new();
    for (job_id, body) in rows {
        streams.entry(job_id).or_default().push(logged_event(&body));
    }
    let mut problems = Vec::new();
    for (job_id, projected) in &projection {
        let Some(events) = streams.get(job_id) else {
            problems.push(format!("{job_id}: no events"));
            continue;
        };
        match jobfold_schemas::fold::fold(events) {
            Err(e) => problems.push(format!("{job_id}: {e}")),
            Ok(folded) => {
                let previous = folded
                    .previous_ambiguous
                    .map(|ambiguous| if ambiguous { "ambiguous" } else { "failed" }.to_owned());
                // The row's result is the one the log's success says.
                let result = events.iter().rev().find_map(|e| match &e.payload {
                    jobfold_schemas::Payload::JobSucceeded(s) => {
                        Some(serde_json::from_str(&s.result).expect("a logged result is JSON"))
                    }
                    _ => None,
                });
                let got = (
                    folded.status.as_str().to_owned(),
                    folded.generation,
                    folded.attempt,
                    folded.stream_version,
                    previous,
                    result,
                );
                if &got != projected {
                    problems.push(format!(
                        "{job_id}: fold gives {got:?}, projection has {projected:?}"
                    ));
                }
            }
        }
    }
    problems
}

/// A relay and a processor of an [`Installation`], in this process; [`Pipeline::stop`] ends
/// them and asserts they ended cleanly.
#[derive(Debug)]
pub struct Pipeline {
    shutdown: tokio_util::sync::CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Pipeline {
    /// The relay, and if `processor`, the test processor ([`crate::handlers::run`]).
    pub fn start(it: &Installation, processor: bool) -> Self {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let mut tasks = vec![tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()))];
        if processor {
            tasks.push(tokio::spawn(crate::handlers::run(it.config.clone(), shutdown.clone())));
        }
        Self { shutdown, tasks }
    }

    /// The relay and `processor` (with handlers of a test's own); its kinds are registered
    /// before it returns, so jobs of them are accepted at once.
    ///
    /// # Panics
    /// The kinds could not be registered.
    pub async fn with_processor(
        it: &Installation,
        processor: jobfold_processor::Processor,
    ) -> Self {
        processor.register_kinds(&it.pool).await.unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let tasks = vec![
            tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone())),
            tokio::spawn(processor.run(shutdown.clone())),
        ];
        Self { shutdown, tasks }
    }

    /// The relay and the worker alone (no processor services) running `handlers`.
    pub async fn with_handlers(
        it: &Installation,
        handlers: jobfold_processor::handler::Handlers,
    ) -> Self {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let relay = tokio::spawn(jobfold_relay::run(it.config.clone(), shutdown.clone()));
        let worker = tokio::spawn(jobfold_processor::worker::run(
            it.config.clone(),
            it.pool.clone(),
            Decoder::new(it.registry()),
            it.events().await,
            handlers,
            shutdown.clone(),
        ));
        Self { shutdown, tasks: vec![relay, worker] }
    }

    /// Shuts both down and waits for them.
    ///
    /// # Panics
    /// One failed or panicked.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            task.await.unwrap().unwrap();
        }
    }
}
