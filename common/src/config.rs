//! One typed configuration for every jobfold binary.
//!
//! Sources, later ones winning: the defaults compiled in (`common/default.toml`), an optional
//! TOML file (`--config`), then environment variables prefixed `JOBFOLD_`, with `__` between
//! levels: `JOBFOLD_DATABASE_URL`, `JOBFOLD_RELAY__BATCH_SIZE`. librdkafka options go under
//! `[kafka]` in the file, or as `JOBFOLD_KAFKA__LINGER_MS` (dots written as `_`).
//!
//! Invalid configuration is one [`ConfigError`] naming the key; binaries print it and exit
//! with status 2.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

/// Exit status for invalid configuration.
pub const EXIT_CONFIG: i32 = 2;

/// Largest error text kept from a handler (in events, the job row and quarantine); longer
/// text is cut at a character boundary, so one verbose failure cannot make an event too large.
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// The longest `inline_window`: a lease transaction holds its rows and connection that long.
pub const MAX_INLINE_WINDOW: Duration = Duration::from_secs(1);

/// Largest `document_id`, `kind` and idempotency key, in bytes (a kind's name in `[kinds]`
/// too).
pub const MAX_NAME_BYTES: usize = 512;

/// For a binary's `main`: a run that failed on invalid configuration (found only once the
/// broker was asked, such as a size limit the events topic cannot hold) prints the message
/// and exits with status 2, like a configuration error at load; other errors are returned.
///
/// # Errors
/// The run's own error, when it is not a [`ConfigError`].
pub fn exit_on_config_error(binary: &str, result: anyhow::Result<()>) -> anyhow::Result<()> {
    if let Err(e) = &result
        && let Some(config) = e.chain().find_map(|c| c.downcast_ref::<ConfigError>())
    {
        eprintln!("{binary}: {config}");
        std::process::exit(EXIT_CONFIG);
    }
    result
}

const DEFAULTS: &str = include_str!("../default.toml");

/// A secret: shown as `*********` by `Debug`, `Display` and `Serialize`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Sensitive<T>(T);

impl<T> Sensitive<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The secret itself; call only where it is used, never to log it.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Sensitive<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*********")
    }
}

impl<T> fmt::Display for Sensitive<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("*********")
    }
}

impl<T> Serialize for Sensitive<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("*********")
    }
}

/// A URL setting that may hold secrets: the schema registry's, a kind's handler's.
/// Credentials in it (`https://user:secret@host/...`) and the values of its query
/// (`?token=...`) are shown as `*********` by `Debug`, `Display` and `Serialize`; the
/// registry's credentials are sent as basic authentication, never as part of a URL an error
/// message could repeat ([`Config::registry`]).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL as configured, credentials included; call only where it is used.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL without credentials, and the credentials it carried (user, password).
    pub fn split_credentials(&self) -> (String, Option<(String, Option<String>)>) {
        match url::Url::parse(&self.0) {
            Ok(mut parsed) if !parsed.username().is_empty() || parsed.password().is_some() => {
                let decode = |s: &str| {
                    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
                };
                let user = decode(parsed.username());
                let password = parsed.password().map(decode);
                let _ = parsed.set_username("");
                let _ = parsed.set_password(None);
                (parsed.to_string(), Some((user, password)))
            }
            _ => (self.0.clone(), None),
        }
    }

    /// The URL as shown: credentials and query values replaced by `*********` — in one
    /// that does not parse too, whatever its authority holds before an `@`.
    fn shown(&self) -> String {
        redacted(&self.0)
    }
}

/// `url` fit to log or show: credentials and the values of its query replaced by
/// `*********` — in one that does not parse too, whatever its authority holds before an `@`
/// and whatever follows a `?`.
pub fn redacted(url: &str) -> String {
    let hidden = SecretUrl(url.to_owned()).without_credentials_shown();
    match hidden.split_once('?') {
        None => hidden,
        Some((base, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, Some(f)),
                None => (query, None),
            };
            let shown: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) => format!("{key}=*********"),
                    None => pair.to_owned(),
                })
                .collect();
            let mut out = format!("{base}?{}", shown.join("&"));
            if let Some(f) = fragment {
                out.push('#');
                out.push_str(f);
            }
            out
        }
    }
}

impl SecretUrl {
    fn without_credentials_shown(&self) -> String {
        match self.split_credentials() {
            (bare, Some(_)) => match url::Url::parse(&bare) {
                Ok(mut parsed) => {
                    let _ = parsed.set_username("*********");
                    parsed.to_string()
                }
                Err(_) => "*********".into(),
            },
            (bare, None) => {
                let (scheme, rest) = bare.split_once("://").unwrap_or(("", bare.as_str()));
                let end = rest.find('/').unwrap_or(rest.len());
                match rest[..end].rfind('@') {
                    Some(at) => format!("{scheme}://*********{}", &rest[at..]),
                    None => bare,
                }
            }
        }
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.shown())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown())
    }
}

impl Serialize for SecretUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.shown())
    }
}

/// The whole configuration. Each binary reads the sections it needs.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `postgres://` URL of the jobfold database (contains the password: sensitive). Several
    /// hosts, `postgres://u:p@h1:5432,h2:5432/jobfold?target_session_attrs=read-write`, name a
    /// primary and its standbys: every pool connects to whichever accepts writes, and moves
    /// when that changes (`crate::db`, `crate::pg_hosts`).
    pub database_url: Sensitive<String>,
    /// How jobfold holds Postgres to its guarantees, `[database]`.
    #[serde(default)]
    pub database: Database,
    /// Kafka bootstrap servers, comma separated.
    pub kafka_brokers: String,
    /// Base URL of the Confluent-compatible schema registry API.
    pub schema_registry_url: SecretUrl,
    /// User for the registry's basic authentication (with `schema_registry_password`).
    #[serde(default)]
    pub schema_registry_username: Option<String>,
    #[serde(default)]
    pub schema_registry_password: Option<Sensitive<String>>,
    /// Bearer token for the registry (instead of a user and password).
    #[serde(default)]
    pub schema_registry_token: Option<Sensitive<String>>,
    /// Where the processor serves the HTTP API.
    pub http_addr: SocketAddr,
    /// Where Prometheus scrapes `/metrics`.
    pub metrics_addr: SocketAddr,
    /// Log as JSON lines instead of text.
    pub log_json: bool,
    pub topics: Topics,
    pub relay: Relay,
    pub accept: Accept,
    pub intake: Intake,
    pub processor: Processor,
    /// What is deleted, and after how long; nothing by default.
    pub retention: Retention,
    /// One bearer token with the `admin` role, named `api_token` (see [`Http::tokens`] for
    /// several, with roles, stored hashed); none and no `http.tokens`: the API is open.
    #[serde(default)]
    pub api_token: Option<Sensitive<String>>,
    /// Who may call the HTTP API: tokens and their roles, the hosts it answers to.
    #[serde(default)]
    pub http: Http,
    /// The operator console's settings, `[console]`.
    #[serde(default)]
    pub console: Console,
    /// Settings per job kind, `[kinds.<kind>]`; see [`Kind`].
    #[serde(default)]
    pub kinds: BTreeMap<String, Kind>,
    /// Jobs accepted on a schedule, `[periodic.<name>]`; see [`Periodic`].
    #[serde(default)]
    pub periodic: BTreeMap<String, Periodic>,
    /// librdkafka options passed to every client, e.g. `"security.protocol" = "SASL_SSL"`.
    /// Values of secret options (`sasl.password`, `ssl.key.password`, ...) are redacted
    /// wherever the configuration is shown.
    #[serde(default)]
    pub kafka: KafkaOptions,
}

/// `[database]`: what jobfold asks of Postgres beyond the URL.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Database {
    /// Refuse to start (exit 2) against a primary that acknowledges a commit before a
    /// synchronous standby has it (`synchronous_standby_names` empty, or `synchronous_commit`
    /// `off` or `local` for jobfold's sessions): a failover to a standby would then lose jobs
    /// already acknowledged to their callers.
    pub require_sync_standby: bool,
    /// With several hosts in `database_url`: how often each pool asks whether its host still
    /// accepts writes, and looks for the one that does once it does not (a failover).
    #[serde(with = "humantime_serde")]
    pub primary_check: Duration,
}

impl Default for Database {
    fn default() -> Self {
        Self { require_sync_standby: false, primary_check: Duration::from_secs(1) }
    }
}

/// librdkafka options, by their librdkafka names. `Debug` and `Serialize` show the values of
/// secret options as `*********`.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct KafkaOptions(pub BTreeMap<String, String>);

impl KafkaOptions {
    /// Whether `option`'s value is a secret: passwords, secrets, private keys, OAuth config.
    pub fn is_secret(option: &str) -> bool {
        option.contains("password")
            || option.contains("secret")
            || option == "ssl.key.pem"
            || option == "ssl_key"
            || option == "sasl.oauthbearer.config"
    }

    fn shown(&self) -> BTreeMap<&str, &str> {
        self.0
            .iter()
            .map(|(k, v)| (k.as_str(), if Self::is_secret(k) { "*********" } else { v.as_str() }))
            .collect()
    }
}

impl fmt::Debug for KafkaOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.shown()).finish()
    }
}

impl Serialize for KafkaOptions {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.shown().serialize(s)
    }
}

/// What a token may do on the HTTP API, each role all that the one before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything the console shows: jobs (their inputs and results), events, dead letters,
    /// quarantine, kinds, schedules, the overview, the audit trail.
    Read,
    /// `read`, and accept jobs (`POST /v1/jobs`, `/v1/jobs/batch`): an upstream service.
    Submit,
    /// `submit`, and change jobs: cancel, replay, run now, pause and resume kinds,
    /// re-inject dead letters.
    Operate,
    /// `operate`, and delete (dead letters).
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Read, Role::Submit, Role::Operate, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Submit => "submit",
            Role::Operate => "operate",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A token the HTTP API takes: its secret is stored as the SHA-256 of the secret, in hex
/// (`jobfold token` makes one), so the configuration holds nothing that signs in. Shown
/// (`Debug`, `Serialize`) without its digest all the same.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiToken {
    /// Who uses it: recorded in the audit trail of each change it makes.
    pub name: String,
    pub role: Role,
    /// SHA-256 of the secret, 64 hex digits.
    pub sha256: String,
}

impl fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiToken")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("sha256", &"*********")
            .finish()
    }
}

impl Serialize for ApiToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut shown = s.serialize_struct("ApiToken", 3)?;
        shown.serialize_field("name", &self.name)?;
        shown.serialize_field("role", &self.role)?;
        shown.serialize_field("sha256", "*********")?;
        shown.end()
    }
}

/// The HTTP API's access settings, `[http]`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Http {
    /// `Host` names (optionally `:port`; `*.example.com` for a domain's names; `*` for any)
    /// the API answers to; any other gets 421 before a handler runs, so a page that rebinds
    /// its own name to this address reaches nothing. Besides these: `localhost`,
    /// `127.0.0.1`, `[::1]` and `http_addr`'s address.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Tokens and their roles; with one (or `api_token`) configured, every route but
    /// `/healthz`, `/readyz`, the console's page and (unless `open_metrics = false`)
    /// `/metrics` needs a token.
    #[serde(default)]
    pub tokens: Vec<ApiToken>,
    /// `/metrics` on the API's address answers without a token.
    #[serde(default = "yes")]
    pub open_metrics: bool,
    /// Failed authentications a client address may make in a minute; past them it is
    /// answered 429 until the minute is over, even with a right token.
    #[serde(default = "auth_failures")]
    pub auth_failures_per_minute: u32,
    /// The longest a request may take, its body's upload included (not the health checks
    /// or `/metrics`); past it the caller gets 408 `request_timeout`, and whatever it asked
    /// may or may not have happened (an accept: retry with the same idempotency key).
    #[serde(default = "request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Requests handled at once (not the health checks or `/metrics`); one more is
    /// answered 503 `overloaded` with `Retry-After` at once rather than queued.
    #[serde(default = "max_concurrent_requests")]
    pub max_concurrent_requests: usize,
}

fn yes() -> bool {
    true
}

fn request_timeout() -> Duration {
    Duration::from_secs(30)
}

fn max_concurrent_requests() -> usize {
    1024
}

fn auth_failures() -> u32 {
    10
}

impl Default for Http {
    fn default() -> Self {
        Self {
            allowed_hosts: Vec::new(),
            tokens: Vec::new(),
            open_metrics: true,
            auth_failures_per_minute: auth_failures(),
            request_timeout: request_timeout(),
            max_concurrent_requests: max_concurrent_requests(),
        }
    }
}

/// The operator console's settings.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Console {
    /// Where a trace is shown, `{trace_id}` standing for its id
    /// (`https://tempo.example/explore?traceId={trace_id}`): trace ids become links.
    #[serde(default)]
    pub trace_url: Option<String>,
}

/// Topic names and how the relay creates them.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Topics {
    /// Relay → processors and analytics.
    pub events: String,
    /// Upstream producers → intake.
    pub requests: String,
    /// Partitions for topics the relay creates.
    pub partitions: i32,
    /// Replicas of each partition: at start, a topic with fewer is refused.
    pub replication_factor: i32,
    /// Replicas that must have an event before the broker acknowledges it (the relay
    /// produces with `acks=all`): set on topics the relay creates, and at start a topic
    /// with a lower `min.insync.replicas` is refused. At most `replication_factor`.
    pub min_insync_replicas: i32,
    /// `retention.ms` of the events topic; `-1` keeps events forever.
    pub events_retention_ms: i64,
}

/// The outbox relay.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Relay {
    /// Outbox rows claimed and produced per round trip.
    pub batch_size: u32,
    /// Fallback poll when no notification arrives.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How often a standby relay tries to become the active one.
    #[serde(with = "humantime_serde")]
    pub standby_retry: Duration,
    /// Published outbox rows are deleted after this long (job_events is kept). `0s` deletes
    /// each row as soon as its delivery is acknowledged, instead of marking it: no published
    /// history in the outbox, and about half the relay's database work.
    #[serde(with = "humantime_serde")]
    pub prune_after: Duration,
    #[serde(with = "humantime_serde")]
    pub prune_interval: Duration,
    /// Time to finish the batch in flight on shutdown.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Advisory lock key of the active relay; relays sharing a key share one active slot.
    pub lock_key: i64,
    /// A transaction open this long that holds back publication (the relay reads only
    /// below the oldest running transaction) is logged with its backend's pid, database and
    /// application.
    #[serde(with = "humantime_serde")]
    pub horizon_warn_after: Duration,
    /// How often the active relay reads the events topic's `max.message.bytes` again, so a
    /// limit changed while it runs is followed: events over a lowered one are parked before
    /// they are sent, and parked events that fit a raised one are sent again.
    #[serde(with = "humantime_serde")]
    pub limit_check_interval: Duration,
}

/// Running jobs.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Processor {
    /// Run jobs (consume the events topic). Off: the processor only accepts.
    pub enabled: bool,
    /// The processors' consumer group.
    pub group: String,
    /// This processor's own name in its consumer groups (Kafka's `group.instance.id`,
    /// static membership): one per process, kept across its restarts (a StatefulSet pod's
    /// name, a systemd unit's instance). A processor restarted under the same name within
    /// the session time-out gets its partitions back without a rebalance; none set, each
    /// start joins as a new member and the group waits out the dead one's session first.
    #[serde(default)]
    pub group_instance_id: Option<String>,
    /// How long a lease lasts without a heartbeat.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often a running job's lease is extended.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    /// How long a lease transaction waits for its jobs' handlers before it commits: an
    /// attempt finished within it commits in the same transaction as its lease (one commit
    /// a job, not two), a longer one runs on under its committed lease. `0s`: every lease
    /// commits before its handler runs. It holds the batch's job rows locked and a
    /// connection for at most this long; at most 1s.
    #[serde(with = "humantime_serde")]
    pub inline_window: Duration,
    /// Jobs running at once in this process, across partitions. Only running jobs hold a
    /// slot: a job waiting behind its document's running one, or for its kind's
    /// `concurrency`, holds none.
    pub max_in_flight: usize,
    /// Messages one partition may hold in memory (waiting behind their document, or
    /// running); past it the partition is paused until it holds half.
    pub max_buffered: usize,
    /// Bytes of messages one partition may hold in memory; as `max_buffered`.
    pub max_buffered_bytes: usize,
    /// Largest result a handler may return, as JSON, in bytes. A larger one ends the attempt
    /// as a permanent failure (the job is quarantined with the reason): its `JobSucceeded`
    /// event must fit the events topic's `max.message.bytes`.
    pub max_output_bytes: usize,
    /// Postgres connections of the processor's pool (leases, completions, heartbeats).
    pub db_connections: u32,
    /// First retry delay; doubled per attempt, capped, with full jitter.
    #[serde(with = "humantime_serde")]
    pub retry_base: Duration,
    #[serde(with = "humantime_serde")]
    pub retry_cap: Duration,
    /// Quarantine owner of kinds without `[kinds.<kind>] owner`.
    pub default_owner: String,
    /// How long one run may take: past it the run is cancelled and dropped, and the attempt
    /// fails retryably, so every attempt ends. `0s`: no limit (only when asked for).
    #[serde(with = "humantime_serde")]
    pub run_timeout: Duration,
    /// The longest wait an outside answer can ask for: a `Retry-After` (or a handler's
    /// `retry_after`, or a snooze) past it is cut to it, so no header can pause a kind or a
    /// job for longer.
    #[serde(with = "humantime_serde")]
    pub max_retry_after: Duration,
    /// How often one job may be snoozed (a `503` with `Retry-After`, or
    /// `HandlerError::snooze`) without spending an attempt; later snoozes spend one.
    pub max_snoozes: i32,
    /// A job whose run killed its processor this many times (the process died while it
    /// ran, before anything of the attempt committed) is quarantined, saying so.
    pub max_crashes: i32,
    /// How long a job one death short of `max_crashes` (a suspect, run isolated) waits
    /// before that run: its partition's other documents move on meanwhile, so a job that
    /// kills its process costs its partition one rebalance, not a crash loop. `0s`: no wait.
    #[serde(with = "humantime_serde")]
    pub crash_backoff: Duration,
    /// How long a remote handler's connection may take to open.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// A remote handler that answered `202 Accepted` must call back (a heartbeat or its
    /// completion) within this, each time, or its attempt fails as one whose outcome is
    /// unknown.
    #[serde(with = "humantime_serde")]
    pub callback_timeout: Duration,
    /// Where remote handlers reach this processor's API to call back (`http://10.0.3.7:8080`,
    /// a pod's own address): the base of the `heartbeat_url` and `complete_url` each call
    /// carries. Unset: `http://` and `http_addr` (its host name when it listens on all
    /// addresses).
    #[serde(default)]
    pub callback_base_url: Option<String>,
    /// How long a revoked partition's running jobs may take to finish before it is released.
    #[serde(with = "humantime_serde")]
    pub revoke_timeout: Duration,
    /// How often a processor looks at its group for partitions of the events topic that no
    /// member holds although the group is stable (a static member that died while handing
    /// them on); one left so past `revoke_timeout`, the session time-out and a look makes
    /// it leave and rejoin.
    #[serde(with = "humantime_serde")]
    pub assignment_check: Duration,
    /// On the first SIGTERM (or SIGINT): how long running handlers may go on to finish, their
    /// tokens untouched, before they are cancelled and their jobs' leases given back.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// How often the reaper looks for expired leases and stalled jobs.
    #[serde(with = "humantime_serde")]
    pub reaper_interval: Duration,
    /// How often the unfinished-work gauges are read from Postgres (and the consumer lag
    /// from librdkafka's statistics).
    #[serde(with = "humantime_serde")]
    pub gauge_interval: Duration,
    /// A lease expired this long ago is dispatched again by the reaper.
    #[serde(with = "humantime_serde")]
    pub reaper_grace: Duration,
    /// A job still queued this long after acceptance (its dispatch never arrived) is
    /// dispatched again by the reaper. Longer than any expected backlog.
    #[serde(with = "humantime_serde")]
    pub stall_after: Duration,
}

/// Deleting what ended jobs leave behind, `[retention]`. Each setting absent (the default)
/// keeps its rows for ever: Postgres is the log of record until you say otherwise. Each
/// counts from the job's end (`finished_at`); only jobs in a final state count
/// (`succeeded`, `superseded`, `cancelled` — a quarantined job waits for an operator).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    /// Events (`job_events`, and their `outbox` rows) of jobs ended this long ago, once on
    /// Kafka: the events topic keeps the log (`topics.events_retention_ms`).
    #[serde(default, with = "humantime_serde")]
    pub job_events_after: Option<Duration>,
    /// Results (`jobs.result`, emptied) of jobs ended this long ago.
    #[serde(default, with = "humantime_serde")]
    pub job_results_after: Option<Duration>,
    /// The jobs themselves, ended this long ago, with every row of theirs — except each
    /// document and kind's newest succeeded version, which supersedes older versions
    /// submitted late. A job's idempotency key is remembered as long as its job.
    #[serde(default, with = "humantime_serde")]
    pub jobs_after: Option<Duration>,
    /// How often each processor sweeps.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Jobs one sweep statement handles, at most.
    pub batch: usize,
}

impl Retention {
    /// The settings by the table they delete from, those set only.
    pub fn sweeps(&self) -> Vec<(&'static str, Duration)> {
        [
            ("job_events", self.job_events_after),
            ("job_results", self.job_results_after),
            ("jobs", self.jobs_after),
        ]
        .into_iter()
        .filter_map(|(name, after)| Some((name, after?)))
        .collect()
    }
}

/// The intake consumer on the requests topic.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Intake {
    /// Run the intake consumer in the processor.
    pub enabled: bool,
    /// Its consumer group.
    pub group: String,
    /// Most requests accepted in one transaction: the intake takes what the consumer has
    /// fetched, up to this many, and accepts them together.
    pub max_batch: usize,
}

/// Accepting jobs.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Accept {
    /// Largest accepted request body (HTTP) or input (all paths), in bytes.
    pub max_input_bytes: usize,
    /// Largest body of `POST /v1/jobs/batch`, in bytes.
    pub max_batch_bytes: usize,
    /// Attempt budget of jobs whose kind has no `[kinds.<kind>] max_attempts`.
    pub default_max_attempts: i32,
    /// Elapsed-time budget from acceptance; none if absent.
    #[serde(default, with = "humantime_serde")]
    pub default_deadline: Option<Duration>,
    /// Accept jobs of any kind. Off: a kind no processor has registered (run with a handler
    /// for it) is refused, `unknown_kind`.
    #[serde(default)]
    pub any_kind: bool,
    /// How far in the past a scheduled job's `run_at` may be (it then runs at once).
    #[serde(with = "humantime_serde")]
    pub schedule_tolerance: Duration,
    /// How far ahead a job may be scheduled.
    #[serde(with = "humantime_serde")]
    pub max_schedule_ahead: Duration,
    /// How long an HTTP caller waits for its accept to be durable (committed, and with a
    /// synchronous standby, on the standby) before it is answered 503: retry with the same
    /// idempotency key. The commit is not cancelled: Postgres keeps a commit cancelled while
    /// it waits for the standby, unreplicated, so it goes on and ends in its own time.
    #[serde(with = "humantime_serde")]
    pub commit_timeout: Duration,
}

/// A job accepted on a schedule, `[periodic.<name>]`: one job per tick of `cron` (read in
/// `time_zone`), accepted by whichever processor holds the group's schedule lease; the tick
/// is the job's idempotency key, so no tick has two jobs across restarts and rebalances.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Periodic {
    /// The kind of the jobs.
    pub kind: String,
    /// A cron pattern: five fields (minute hour day-of-month month day-of-week), or six with
    /// seconds first; `@hourly`, `@daily` and the like.
    pub cron: String,
    /// The IANA time zone the pattern is read in (`Europe/Paris`); UTC if absent.
    #[serde(default = "utc")]
    pub time_zone: String,
    /// Each job's input (any JSON; a TOML table here); `{}` if absent.
    #[serde(default)]
    pub input: Option<serde_json::Value>,
    /// A tick passed by less than this (the schedule's holder died, a deploy) still gets its
    /// job, late; at most an hour.
    #[serde(default = "default_catch_up", with = "humantime_serde")]
    pub catch_up: Duration,
    /// Ticks passed by more than `catch_up` (no processor ran): `skip` them, or `run_once`
    /// for all of them together (one job, for the newest).
    #[serde(default)]
    pub missed: Missed,
}

fn utc() -> String {
    "UTC".into()
}

fn default_catch_up() -> Duration {
    Duration::from_secs(60)
}

/// What a periodic schedule does with ticks passed by more than its `catch_up`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    #[default]
    Skip,
    RunOnce,
}

/// Longest name of a periodic schedule, in bytes (it is part of its jobs' document id and
/// idempotency keys).
pub const MAX_PERIODIC_NAME_BYTES: usize = 200;

impl Periodic {
    /// The pattern, parsed (seconds optional).
    ///
    /// # Errors
    /// It does not parse.
    pub fn schedule(&self) -> Result<croner::Cron, String> {
        croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Optional)
            .build()
            .parse(&self.cron)
            .map_err(|e| e.to_string())
    }

    /// The time zone, parsed.
    ///
    /// # Errors
    /// It names no IANA zone.
    pub fn zone(&self) -> Result<chrono_tz::Tz, String> {
        self.time_zone.parse::<chrono_tz::Tz>().map_err(|e| e.to_string())
    }
}

/// The settings of one job kind, `[kinds.<kind>]`: each one absent falls back to the global
/// setting named in its comment.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Kind {
    /// Jobs of this kind running at once in one processor (else only
    /// `processor.max_in_flight` bounds them).
    #[serde(default)]
    pub concurrency: Option<usize>,
    /// `processor.lease_ttl`.
    #[serde(default, with = "humantime_serde")]
    pub lease_ttl: Option<Duration>,
    /// `processor.heartbeat`.
    #[serde(default, with = "humantime_serde")]
    pub heartbeat: Option<Duration>,
    /// `processor.inline_window`: `0s` for a kind whose runs are never short, so its leases
    /// are not held back waiting for them.
    #[serde(default, with = "humantime_serde")]
    pub inline_window: Option<Duration>,
    /// `processor.run_timeout` (`0s`: no limit).
    #[serde(default, with = "humantime_serde")]
    pub run_timeout: Option<Duration>,
    /// For a kind run at `url`: how long one call may take in all, from connecting to the
    /// last byte of the answer (else its `run_timeout`).
    #[serde(default, with = "humantime_serde")]
    pub request_timeout: Option<Duration>,
    /// For a kind run at `url`: `processor.connect_timeout`.
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// `processor.max_retry_after`.
    #[serde(default, with = "humantime_serde")]
    pub max_retry_after: Option<Duration>,
    /// `processor.max_snoozes`.
    #[serde(default)]
    pub max_snoozes: Option<i32>,
    /// `processor.max_crashes`.
    #[serde(default)]
    pub max_crashes: Option<i32>,
    /// `processor.crash_backoff`.
    #[serde(default, with = "humantime_serde")]
    pub crash_backoff: Option<Duration>,
    /// `accept.default_max_attempts`.
    #[serde(default)]
    pub max_attempts: Option<i32>,
    /// `accept.default_deadline`.
    #[serde(default, with = "humantime_serde")]
    pub deadline: Option<Duration>,
    /// `processor.retry_base`.
    #[serde(default, with = "humantime_serde")]
    pub retry_base: Option<Duration>,
    /// `processor.retry_cap`.
    #[serde(default, with = "humantime_serde")]
    pub retry_cap: Option<Duration>,
    /// `processor.max_output_bytes`.
    #[serde(default)]
    pub max_output_bytes: Option<usize>,
    /// Who must act on this kind's quarantined jobs: `processor.default_owner`.
    #[serde(default)]
    pub owner: Option<String>,
    /// An `http://` or `https://` URL: the shipped processor runs this kind by calling it (a
    /// handler in any language; the protocol is in docs/processor.md). Absent: a handler
    /// registered in code runs it. Shown with its credentials and query values hidden.
    #[serde(default)]
    pub url: Option<SecretUrl>,
    /// The provider's request quota: attempts of this kind started per second, by all of
    /// the group's processors together (else no limit).
    #[serde(default)]
    pub rate_per_second: Option<f64>,
    /// The provider's cost quota: cost units (a model's tokens, say; each job's from its
    /// handler) per minute, by all of the group's processors together (else no limit).
    #[serde(default)]
    pub cost_per_minute: Option<f64>,
    /// For a kind run at `url`: where a job's cost is in its input, as a JSON pointer
    /// (`/estimated_tokens`); a job without one costs 1.
    #[serde(default)]
    pub cost_pointer: Option<String>,
    /// For a kind run at `url`: the secret (at least 32 bytes) that signs every call
    /// (`Jobfold-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`) and that
    /// the handler's callbacks must be signed with. Absent: calls are not signed, and
    /// callbacks need what any write of the API needs (a token, when tokens are set).
    #[serde(default)]
    pub secret: Option<Sensitive<String>>,
    /// For a kind run at `url`: the handler speaks HTTP/2 — without TLS for an `http://`
    /// URL (h2c, prior knowledge), by ALPN (`h2` only) for an `https://` one — so its calls
    /// share connections (streams of one), however many start at once. Without it, an
    /// `https://` handler offering HTTP/2 gets it by ALPN, but calls that start together
    /// before the first connection is up each open one.
    #[serde(default)]
    pub http2: Option<bool>,
    /// For a kind run at an `https://` `url` whose certificate a private authority signed:
    /// a PEM file of the authority's certificates, trusted for this kind's calls besides the
    /// system's.
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// For a kind run at `url` whose handler answers `202 Accepted` and completes by calling
    /// back: how long it may go without a heartbeat before its attempt fails as one whose
    /// outcome is unknown: `processor.callback_timeout`.
    #[serde(default, with = "humantime_serde")]
    pub callback_timeout: Option<Duration>,
}

/// One kind's settings with the global defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct KindSettings {
    pub concurrency: Option<usize>,
    pub lease_ttl: Duration,
    pub heartbeat: Duration,
    pub inline_window: Duration,
    /// None: no limit (`0s`, asked for explicitly).
    pub run_timeout: Option<Duration>,
    /// A remote call's whole time: `request_timeout`, else the run's.
    pub request_timeout: Option<Duration>,
    pub connect_timeout: Duration,
    pub max_retry_after: Duration,
    pub max_snoozes: i32,
    pub max_crashes: i32,
    pub crash_backoff: Duration,
    pub max_attempts: i32,
    pub deadline: Option<Duration>,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    pub max_output_bytes: usize,
    pub owner: String,
    pub rate_per_second: Option<f64>,
    pub cost_per_minute: Option<f64>,
    /// The secret signing calls to the kind's `url` and its callbacks, if any.
    pub secret: Option<Sensitive<String>>,
    pub callback_timeout: Duration,
    /// Calls in HTTP/2 only (h2c, or `h2` by ALPN).
    pub http2: bool,
    /// Authorities trusted for the kind's `https://` calls besides the system's (PEM).
    pub ca_file: Option<std::path::PathBuf>,
}

/// What accepting a job needs: the input limit and each kind's budgets.
#[derive(Debug, Clone)]
pub struct AcceptPolicy {
    pub max_input_bytes: usize,
    /// `accept.any_kind`.
    pub any_kind: bool,
    pub default_max_attempts: i32,
    pub default_deadline: Option<Duration>,
    /// `accept.schedule_tolerance`.
    pub schedule_tolerance: Duration,
    /// `accept.max_schedule_ahead`.
    pub max_schedule_ahead: Duration,
    pub kinds: BTreeMap<String, Kind>,
}

impl AcceptPolicy {
    /// The attempt budget and deadline for `kind`.
    pub fn budget(&self, kind: &str) -> (i32, Option<Duration>) {
        let settings = self.kinds.get(kind);
        (
            settings.and_then(|k| k.max_attempts).unwrap_or(self.default_max_attempts),
            settings.and_then(|k| k.deadline).or(self.default_deadline),
        )
    }
}

impl Config {
    /// How jobfold authenticates to the schema registry: the user and password, the token,
    /// or the credentials the URL carries.
    pub fn registry_auth(&self) -> jobfold_schemas::RegistryAuth {
        use jobfold_schemas::RegistryAuth;
        if let Some(token) = &self.schema_registry_token {
            return RegistryAuth::Bearer(token.expose().clone());
        }
        if let Some(username) = &self.schema_registry_username {
            return RegistryAuth::Basic {
                username: username.clone(),
                password: self.schema_registry_password.as_ref().map(|p| p.expose().clone()),
            };
        }
        match self.schema_registry_url.split_credentials().1 {
            Some((username, password)) => RegistryAuth::Basic { username, password },
            None => RegistryAuth::None,
        }
    }

    /// Settings for the schema registry's client: its URL without credentials, the
    /// credentials sent as [`Config::registry_auth`] says, a request timeout.
    ///
    /// # Errors
    /// The HTTP client could not be built.
    pub fn registry(
        &self,
    ) -> Result<jobfold_schemas::codec::SrSettings, jobfold_schemas::codec::SRCError> {
        let (url, _) = self.schema_registry_url.split_credentials();
        jobfold_schemas::codec::registry_settings_with(&url, &self.registry_auth())
    }
    /// Who must act on a quarantined job of `kind`.
    pub fn quarantine_owner(&self, kind: &str) -> String {
        self.kind(kind).owner
    }

    /// `kind`'s settings, the global ones where `[kinds.<kind>]` does not set them.
    pub fn kind(&self, kind: &str) -> KindSettings {
        let k = self.kinds.get(kind).cloned().unwrap_or_default();
        let p = &self.processor;
        KindSettings {
            concurrency: k.concurrency,
            lease_ttl: k.lease_ttl.unwrap_or(p.lease_ttl),
            heartbeat: k.heartbeat.unwrap_or(p.heartbeat),
            inline_window: k.inline_window.unwrap_or(p.inline_window),
            run_timeout: Some(k.run_timeout.unwrap_or(p.run_timeout)).filter(|t| !t.is_zero()),
            request_timeout: k
                .request_timeout
                .or_else(|| Some(k.run_timeout.unwrap_or(p.run_timeout)))
                .filter(|t| !t.is_zero()),
            connect_timeout: k.connect_timeout.unwrap_or(p.connect_timeout),
            max_retry_after: k.max_retry_after.unwrap_or(p.max_retry_after),
            max_snoozes: k.max_snoozes.unwrap_or(p.max_snoozes),
            max_crashes: k.max_crashes.unwrap_or(p.max_crashes),
            crash_backoff: k.crash_backoff.unwrap_or(p.crash_backoff),
            max_attempts: k.max_attempts.unwrap_or(self.accept.default_max_attempts),
            deadline: k.deadline.or(self.accept.default_deadline),
            retry_base: k.retry_base.unwrap_or(p.retry_base),
            retry_cap: k.retry_cap.unwrap_or(p.retry_cap),
            max_output_bytes: k.max_output_bytes.unwrap_or(p.max_output_bytes),
            owner: k.owner.unwrap_or_else(|| p.default_owner.clone()),
            rate_per_second: k.rate_per_second,
            cost_per_minute: k.cost_per_minute,
            secret: k.secret,
            callback_timeout: k.callback_timeout.unwrap_or(p.callback_timeout),
            http2: k.http2.unwrap_or(false),
            ca_file: k.ca_file,
        }
    }

    /// The shortest heartbeat of any kind: how often a processor's heartbeat statement runs.
    pub fn shortest_heartbeat(&self) -> Duration {
        self.kinds
            .values()
            .filter_map(|k| k.heartbeat)
            .fold(self.processor.heartbeat, Duration::min)
    }

    /// The policy an `Acceptor` (`jobfold_common::accept`) applies.
    pub fn accept_policy(&self) -> AcceptPolicy {
        AcceptPolicy {
            max_input_bytes: self.accept.max_input_bytes,
            any_kind: self.accept.any_kind,
            default_max_attempts: self.accept.default_max_attempts,
            default_deadline: self.accept.default_deadline,
            schedule_tolerance: self.accept.schedule_tolerance,
            max_schedule_ahead: self.accept.max_schedule_ahead,
            kinds: self.kinds.clone(),
        }
    }
}

/// Invalid configuration, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A source could not be read, or a value does not fit its key.
    #[error("invalid configuration: {}", describe(.0))]
    Load(#[from] Box<figment::Error>),
    /// A value fits its type but breaks a rule.
    #[error("invalid configuration: key `{key}`: {problem}")]
    Invalid { key: &'static str, problem: String },
    /// A key named at run time (an environment variable, a librdkafka option) is wrong.
    #[error("invalid configuration: {key}: {problem}")]
    Named { key: String, problem: String },
}

/// Every error figment found, each as "key `a.b` (from source): problem".
fn describe(error: &figment::Error) -> String {
    error
        .clone()
        .into_iter()
        .map(|e| {
            let key = e.path.join(".").to_ascii_lowercase();
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(source) => format!(" (from {} {source})", m.name),
                    None => format!(" (from {})", m.name),
                })
                .unwrap_or_default();
            match &e.kind {
                // A misspelt key: named with the nearest one the section has.
                figment::error::Kind::UnknownField(field, expected) => {
                    let section = e.path.iter().rev().skip(1).rev().cloned().collect::<Vec<_>>();
                    let full = |name: &str| {
                        section
                            .iter()
                            .map(String::as_str)
                            .chain([name])
                            .collect::<Vec<_>>()
                            .join(".")
                    };
                    let nearest = expected
                        .iter()
                        .min_by_key(|k| strsim::levenshtein(k, &field.to_ascii_lowercase()))
                        .map(|k| {
                            let var = format!("JOBFOLD_{}", full(k).replace('.', "__"))
                                .to_ascii_uppercase();
                            format!("; did you mean {} ({var})?", full(k))
                        })
                        .unwrap_or_default();
                    format!("key `{}`{source} names no configuration key{nearest}", full(field))
                }
                _ if key.is_empty() => format!("{}{source}", e.kind),
                _ => format!("key `{key}`{source}: {}", e.kind),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether `pattern` is an `http.allowed_hosts` entry: `*`, or a name or address (`*.` before
/// a name: any name under it), optionally with `:port`.
pub fn host_pattern_ok(pattern: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    let name = pattern.strip_prefix("*.").unwrap_or(pattern);
    let (host, port) = split_host_port(name);
    port.is_none_or(|p| p.parse::<u16>().is_ok())
        && !host.is_empty()
        && host.len() <= 253
        && (host.starts_with('[')
            && host.ends_with(']')
            && host[1..host.len() - 1].parse::<std::net::Ipv6Addr>().is_ok()
            || host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
}

/// `host[:port]` split at the port; `[v6]:port` keeps its brackets.
pub fn split_host_port(value: &str) -> (&str, Option<&str>) {
    if value.starts_with('[') {
        return match value.find(']') {
            Some(end) => {
                let port = value[end + 1..].strip_prefix(':');
                (&value[..=end], port)
            }
            None => (value, None),
        };
    }
    match value.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host, Some(port)),
        _ => (value, None),
    }
}

/// Whether `variable` arms this build's fault points ([`crate::failpoint`]); a build without
/// them refuses it as any unknown `JOBFOLD_*` variable.
fn fault_points(variable: &str) -> bool {
    #[cfg(feature = "failpoints")]
    return variable == crate::failpoint::VARIABLE;
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = variable;
        false
    }
}

/// `JOBFOLD_*` variables that are not configuration: the service scripts' (`docker/`), the
/// test harness's and the command line's. Any other `JOBFOLD_*` variable must name a key, but for
/// `JOBFOLD_FAILPOINT` in a build with fault points ([`crate::failpoint`]).
const NOT_CONFIG: [&str; 18] = [
    // The command line's --api and --token.
    "JOBFOLD_API",
    "JOBFOLD_BIN",
    "JOBFOLD_CACHE_DIR",
    "JOBFOLD_CONFIG",
    "JOBFOLD_KAFKA_CONTROLLER_PORT",
    "JOBFOLD_KAFKA_PORT",
    "JOBFOLD_KAFKA_SASL_PASSWORD",
    "JOBFOLD_KAFKA_SASL_PORT",
    "JOBFOLD_KAFKA_SASL_USER",
    "JOBFOLD_PG_BIN",
    "JOBFOLD_PG_PORT",
    "JOBFOLD_REGISTRY_PORT",
    "JOBFOLD_ROOT",
    "JOBFOLD_SASL_BROKERS",
    "JOBFOLD_SASL_PASSWORD",
    "JOBFOLD_SASL_USERNAME",
    "JOBFOLD_STATE_DIR",
    "JOBFOLD_TOKEN",
];

/// The shortest secret a kind's calls are signed with.
pub const MIN_SECRET_BYTES: usize = 32;

/// Top-level keys that `JOBFOLD_*` variables may set.
const ENV_KEYS: [&str; 21] = [
    "database_url",
    "database",
    "api_token",
    "http",
    "console",
    "kafka_brokers",
    "schema_registry_url",
    "schema_registry_username",
    "schema_registry_password",
    "schema_registry_token",
    "http_addr",
    "metrics_addr",
    "log_json",
    "topics",
    "relay",
    "accept",
    "intake",
    "processor",
    "retention",
    "kinds",
    "kafka",
];

impl Config {
    /// Loads defaults, then `file` if given, then `JOBFOLD_*` environment variables.
    ///
    /// # Errors
    /// [`ConfigError`] naming the offending key.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Toml::string(DEFAULTS));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::Invalid {
                    key: "--config",
                    problem: format!("file {} does not exist", path.display()),
                });
            }
            // Parsed alone first, so that a syntax error names the file.
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Named {
                key: format!("file {}", path.display()),
                problem: format!("cannot be read: {e}"),
            })?;
            if let Err(e) = Figment::from(Toml::string(&text)).extract::<figment::value::Dict>() {
                return Err(ConfigError::Named {
                    key: format!("file {}", path.display()),
                    problem: format!("is not valid TOML: {}", e.kind),
                });
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        check_env_names(std::env::vars().map(|(key, _)| key))?;
        let settings = Env::prefixed("JOBFOLD_")
            .filter(|key| {
                let top = key.as_str().split("__").next().unwrap_or_default().to_ascii_lowercase();
                ENV_KEYS.contains(&top.as_str()) && top != "kafka"
            })
            .split("__");
        // librdkafka option names contain dots: JOBFOLD_KAFKA__LINGER_MS is `linger.ms`,
        // kept whole rather than split into nested tables.
        let kafka: BTreeMap<String, String> = std::env::vars()
            .filter_map(|(key, value)| {
                let option = key.strip_prefix("JOBFOLD_KAFKA__")?;
                Some((option.to_ascii_lowercase().replace('_', "."), value))
            })
            .collect();
        let figment = figment.merge(settings).merge(Serialized::default("kafka", kafka));
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// [`Config::load`] for a binary's `main`: on invalid configuration, prints one message
    /// naming the key, prefixed with the binary's name, and exits with status 2.
    pub fn load_or_exit(binary: &str, file: Option<&Path>) -> Self {
        match Self::load(file) {
            Ok(config) => config,
            Err(e) => {
                eprintln!("{binary}: {e}");
                std::process::exit(EXIT_CONFIG);
            }
        }
    }

    /// Rules across keys that types alone cannot express.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first broken rule's key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key, problem: &str| Err(ConfigError::Invalid { key, problem: problem.into() });
        if !self.database_url.expose().starts_with("postgres://")
            && !self.database_url.expose().starts_with("postgresql://")
        {
            return invalid("database_url", "must be a postgres:// URL");
        }
        if let Err(problem) = crate::pg_hosts::Hosts::parse(self.database_url.expose()) {
            return invalid("database_url", &problem);
        }
        if self.database.primary_check.is_zero()
            || self.database.primary_check > Duration::from_secs(60)
        {
            return invalid("database.primary_check", "must be between 1ms and 60s");
        }
        if self.kafka_brokers.trim().is_empty() {
            return invalid("kafka_brokers", "must name at least one broker");
        }
        let registry = self.schema_registry_url.expose();
        if !registry.starts_with("http://") && !registry.starts_with("https://") {
            return invalid("schema_registry_url", "must be an http:// or https:// URL");
        }
        let in_url = self.schema_registry_url.split_credentials().1.is_some();
        if self.schema_registry_password.is_some() && self.schema_registry_username.is_none() {
            return invalid("schema_registry_password", "needs schema_registry_username");
        }
        if self.schema_registry_token.is_some()
            && (self.schema_registry_username.is_some() || in_url)
        {
            return invalid(
                "schema_registry_token",
                "a bearer token or a user and password, not both",
            );
        }
        if self.schema_registry_username.is_some() && in_url {
            return invalid(
                "schema_registry_username",
                "the URL carries a user already: give the credentials once",
            );
        }
        if self.topics.events.is_empty() || self.topics.requests.is_empty() {
            return invalid("topics", "topic names must not be empty");
        }
        if self.topics.events == self.topics.requests {
            return invalid("topics.requests", "must differ from topics.events");
        }
        if self.topics.partitions < 1 {
            return invalid("topics.partitions", "must be at least 1");
        }
        if self.topics.replication_factor < 1 {
            return invalid("topics.replication_factor", "must be at least 1");
        }
        if self.topics.min_insync_replicas < 1
            || self.topics.min_insync_replicas > self.topics.replication_factor
        {
            return invalid(
                "topics.min_insync_replicas",
                "must be at least 1 and at most topics.replication_factor",
            );
        }
        if self.relay.batch_size == 0 || self.relay.batch_size > 100_000 {
            return invalid("relay.batch_size", "must be between 1 and 100000");
        }
        if self.relay.poll_interval.is_zero() {
            return invalid("relay.poll_interval", "must be above zero");
        }
        if self.relay.limit_check_interval < Duration::from_secs(1) {
            return invalid("relay.limit_check_interval", "must be at least 1s");
        }
        if self.intake.group.trim().is_empty() {
            return invalid("intake.group", "must not be empty");
        }
        if self.intake.max_batch == 0 || self.intake.max_batch > 10_000 {
            return invalid("intake.max_batch", "must be between 1 and 10000");
        }
        let p = &self.processor;
        if p.assignment_check < Duration::from_secs(1) {
            return invalid("processor.assignment_check", "must be at least 1s");
        }
        if p.group.trim().is_empty() {
            return invalid("processor.group", "must not be empty");
        }
        if p.group == self.intake.group {
            return invalid("processor.group", "must differ from intake.group");
        }
        if let Some(id) = &p.group_instance_id
            && let Err(problem) = check_group_instance_id(id)
        {
            return invalid("processor.group_instance_id", &problem);
        }
        if p.heartbeat.is_zero() || p.heartbeat * 2 > p.lease_ttl {
            return invalid(
                "processor.heartbeat",
                "must be above zero and at most half of processor.lease_ttl",
            );
        }
        if p.inline_window > MAX_INLINE_WINDOW {
            return invalid("processor.inline_window", "must be at most 1s");
        }
        if p.gauge_interval < Duration::from_millis(100) {
            return invalid("processor.gauge_interval", "must be at least 100ms");
        }
        if self.api_token.as_ref().is_some_and(|t| t.expose().trim().len() < 16) {
            return invalid("api_token", "must be at least 16 characters");
        }
        self.validate_http()?;
        if let Some(url) = &self.console.trace_url {
            let parsed = url::Url::parse(&url.replace("{trace_id}", "0"));
            if !url.contains("{trace_id}")
                || !parsed.is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
            {
                return invalid(
                    "console.trace_url",
                    "must be an http:// or https:// URL holding {trace_id}",
                );
            }
        }
        if p.max_in_flight == 0 {
            return invalid("processor.max_in_flight", "must be at least 1");
        }
        if p.max_buffered == 0 {
            return invalid("processor.max_buffered", "must be at least 1");
        }
        if p.max_buffered_bytes < 1024 {
            return invalid("processor.max_buffered_bytes", "must be at least 1024");
        }
        if p.db_connections < 2 {
            return invalid("processor.db_connections", "must be at least 2");
        }
        if p.retry_base.is_zero() || p.retry_base > p.retry_cap {
            return invalid(
                "processor.retry_base",
                "must be above zero and at most processor.retry_cap",
            );
        }
        if p.connect_timeout.is_zero() {
            return invalid("processor.connect_timeout", "must be above zero");
        }
        if p.max_retry_after.is_zero() {
            return invalid("processor.max_retry_after", "must be above zero");
        }
        if p.max_snoozes < 0 {
            return invalid("processor.max_snoozes", "must be at least 0");
        }
        if p.callback_timeout.is_zero() {
            return invalid("processor.callback_timeout", "must be above zero");
        }
        if let Some(base) = &p.callback_base_url
            && !url::Url::parse(base)
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
        {
            return invalid(
                "processor.callback_base_url",
                "must be an http:// or https:// URL with a host",
            );
        }
        if p.max_crashes < 1 {
            return invalid("processor.max_crashes", "must be at least 1");
        }
        if p.crash_backoff > Duration::from_secs(3600) {
            return invalid("processor.crash_backoff", "must be at most 1h");
        }
        if self.processor.shutdown_timeout > Duration::from_secs(3600) {
            return invalid("processor.shutdown_timeout", "must be at most 1h");
        }
        if self.accept.commit_timeout.is_zero()
            || self.accept.commit_timeout > Duration::from_secs(300)
        {
            return invalid("accept.commit_timeout", "must be between 1ms and 300s");
        }
        if self.accept.max_schedule_ahead.is_zero() {
            return invalid("accept.max_schedule_ahead", "must be above zero");
        }
        if self.accept.max_input_bytes < 2 {
            return invalid("accept.max_input_bytes", "must be at least 2");
        }
        if self.accept.max_batch_bytes < self.accept.max_input_bytes
            || self.accept.max_batch_bytes > 1 << 30
        {
            return invalid(
                "accept.max_batch_bytes",
                "must be at least accept.max_input_bytes and at most 1 GiB",
            );
        }
        if self.accept.default_max_attempts < 1 {
            return invalid("accept.default_max_attempts", "must be at least 1");
        }
        if p.max_output_bytes < 2 {
            return invalid("processor.max_output_bytes", "must be at least 2");
        }
        let r = &self.retention;
        if r.interval < Duration::from_millis(100) {
            return invalid("retention.interval", "must be at least 100ms");
        }
        if r.batch == 0 || r.batch > 100_000 {
            return invalid("retention.batch", "must be between 1 and 100000");
        }
        for (name, after) in r.sweeps() {
            if after < Duration::from_secs(1) {
                return Err(ConfigError::Named {
                    key: format!("key `retention.{name}_after`"),
                    problem: "must be at least 1s".into(),
                });
            }
            if r.jobs_after.is_some_and(|jobs| jobs < after) {
                return Err(ConfigError::Named {
                    key: "key `retention.jobs_after`".into(),
                    problem: format!(
                        "must be at least retention.{name}_after: deleting a job deletes its rows"
                    ),
                });
            }
        }
        for name in self.kinds.keys() {
            self.validate_kind(name)?;
        }
        for name in self.periodic.keys() {
            self.validate_periodic(name)?;
        }
        self.validate_kafka_options()?;
        self.validate_kafka_combination()
    }

    fn validate_http(&self) -> Result<(), ConfigError> {
        let h = &self.http;
        let named = |key: String, problem: &str| {
            Err(ConfigError::Named {
                key: format!("key `http.{key}`"),
                problem: problem.to_owned(),
            })
        };
        for (i, host) in h.allowed_hosts.iter().enumerate() {
            if !host_pattern_ok(host) {
                return named(
                    format!("allowed_hosts[{i}]"),
                    "must be a host name or address, optionally with :port, `*.domain` or `*`",
                );
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, token) in h.tokens.iter().enumerate() {
            let name = token.name.trim();
            if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
                return named(format!("tokens[{i}].name"), "must have 1 to 64 characters");
            }
            if name == "api_token" && self.api_token.is_some() || !names.insert(name) {
                return named(format!("tokens[{i}].name"), "must be unique (api_token counts)");
            }
            if token.sha256.len() != 64 || !token.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return named(
                    format!("tokens[{i}].sha256"),
                    "must be the SHA-256 of the secret in 64 hex digits (`jobfold token`)",
                );
            }
        }
        if h.auth_failures_per_minute == 0 || h.auth_failures_per_minute > 10_000 {
            return named("auth_failures_per_minute".into(), "must be between 1 and 10000");
        }
        // An accept waits up to accept.commit_timeout and is then answered 503, which says
        // to retry; a shorter request time-out would answer first with a vaguer 408.
        if h.request_timeout <= self.accept.commit_timeout
            || h.request_timeout > Duration::from_secs(3600)
        {
            return named(
                "request_timeout".into(),
                "must be longer than accept.commit_timeout and at most 1h",
            );
        }
        if h.max_concurrent_requests == 0 || h.max_concurrent_requests > 65_536 {
            return named("max_concurrent_requests".into(), "must be between 1 and 65536");
        }
        Ok(())
    }

    /// The rules of the global settings, for one kind's settings with the defaults filled in.
    fn validate_kind(&self, name: &str) -> Result<(), ConfigError> {
        let k = self.kind(name);
        let invalid = |key: &str, problem: &str| {
            Err(ConfigError::Named {
                key: format!("key `kinds.{name}.{key}`"),
                problem: problem.to_owned(),
            })
        };
        if name.trim().is_empty() || name.len() > MAX_NAME_BYTES {
            return invalid("", "a kind's name must have 1 to 512 bytes");
        }
        if k.concurrency == Some(0) {
            return invalid("concurrency", "must be at least 1");
        }
        if k.heartbeat.is_zero() || k.heartbeat * 2 > k.lease_ttl {
            return invalid("heartbeat", "must be above zero and at most half of its lease_ttl");
        }
        if k.inline_window > MAX_INLINE_WINDOW {
            return invalid("inline_window", "must be at most 1s");
        }
        if self.kinds.get(name).and_then(|k| k.request_timeout).is_some_and(|t| t.is_zero()) {
            return invalid("request_timeout", "must be above zero");
        }
        if k.connect_timeout.is_zero() {
            return invalid("connect_timeout", "must be above zero");
        }
        if k.max_retry_after.is_zero() {
            return invalid("max_retry_after", "must be above zero");
        }
        if k.max_snoozes < 0 {
            return invalid("max_snoozes", "must be at least 0");
        }
        if k.max_crashes < 1 {
            return invalid("max_crashes", "must be at least 1");
        }
        if k.crash_backoff > Duration::from_secs(3600) {
            return invalid("crash_backoff", "must be at most 1h");
        }
        if k.max_attempts < 1 {
            return invalid("max_attempts", "must be at least 1");
        }
        if k.retry_base.is_zero() || k.retry_base > k.retry_cap {
            return invalid("retry_base", "must be above zero and at most its retry_cap");
        }
        if k.max_output_bytes < 2 {
            return invalid("max_output_bytes", "must be at least 2");
        }
        if k.owner.trim().is_empty() {
            return invalid("owner", "must not be empty");
        }
        let positive = |rate: Option<f64>| rate.is_none_or(|r| r.is_finite() && r > 0.0);
        if !positive(k.rate_per_second) {
            return invalid("rate_per_second", "must be a number above zero");
        }
        if !positive(k.cost_per_minute) {
            return invalid("cost_per_minute", "must be a number above zero");
        }
        if let Some(pointer) = self.kinds.get(name).and_then(|k| k.cost_pointer.as_ref())
            && !pointer.starts_with('/')
        {
            return invalid("cost_pointer", "must be a JSON pointer, starting with /");
        }
        if k.secret.as_ref().is_some_and(|s| s.expose().len() < MIN_SECRET_BYTES) {
            return invalid("secret", "must have at least 32 bytes");
        }
        if k.callback_timeout.is_zero() {
            return invalid("callback_timeout", "must be above zero");
        }
        if let Some(file) = &k.ca_file {
            match std::fs::read_to_string(file) {
                Err(e) => return invalid("ca_file", &format!("{}: {e}", file.display())),
                Ok(pem) if !pem.contains("-----BEGIN CERTIFICATE-----") => {
                    return invalid(
                        "ca_file",
                        &format!("{}: holds no PEM certificate", file.display()),
                    );
                }
                Ok(_) => {}
            }
        }
        if let Some(url) = self.kinds.get(name).and_then(|k| k.url.as_ref()) {
            let parsed = url::Url::parse(url.expose());
            if !parsed
                .as_ref()
                .is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
            {
                return invalid("url", "must be an http:// or https:// URL with a host");
            }
        }
        Ok(())
    }

    fn validate_periodic(&self, name: &str) -> Result<(), ConfigError> {
        let p = &self.periodic[name];
        let invalid = |key: &str, problem: &str| {
            Err(ConfigError::Named {
                key: format!("key `periodic.{name}.{key}`"),
                problem: problem.to_owned(),
            })
        };
        if name.trim().is_empty() || name.len() > MAX_PERIODIC_NAME_BYTES || name.contains('/') {
            return invalid("", "a schedule's name must have 1 to 200 bytes and no /");
        }
        if p.kind.trim().is_empty() || p.kind.len() > MAX_NAME_BYTES {
            return invalid("kind", "must have 1 to 512 bytes");
        }
        if let Err(e) = p.schedule() {
            return invalid("cron", &format!("not a cron pattern: {e}"));
        }
        if p.zone().is_err() {
            return invalid("time_zone", "must name an IANA time zone, such as Europe/Paris");
        }
        if p.catch_up.is_zero() || p.catch_up > Duration::from_secs(3600) {
            return invalid("catch_up", "must be above zero and at most 1h");
        }
        let input = serde_json::to_vec(p.input.as_ref().unwrap_or(&serde_json::json!({})));
        if input.map_or(true, |bytes| bytes.len() > self.accept.max_input_bytes) {
            return invalid("input", "must be JSON within accept.max_input_bytes");
        }
        Ok(())
    }

    /// Every `[kafka]` option must be one librdkafka knows, with a value it takes: checked
    /// here, at start, rather than when the first client is created.
    fn validate_kafka_options(&self) -> Result<(), ConfigError> {
        for (key, value) in &self.kafka.0 {
            let mut client = rdkafka::ClientConfig::new();
            client.set(key, value);
            if let Err(e) = client.create_native_config() {
                let problem = match e {
                    rdkafka::error::KafkaError::ClientConfig(_, description, _, _) => description,
                    other => other.to_string(),
                };
                let shown = if KafkaOptions::is_secret(key) { "*********" } else { value };
                return Err(ConfigError::Named {
                    key: format!("key `kafka.{key}` (JOBFOLD_KAFKA__{})", env_name(key)),
                    problem: format!("librdkafka refuses {shown:?}: {problem}"),
                });
            }
        }
        Ok(())
    }

    /// The `[kafka]` options may not change what the guarantee rests on
    /// ([`FIXED_KAFKA_OPTIONS`]: a value other than jobfold's is refused, naming why), and
    /// together must make clients librdkafka creates: its rules across options
    /// (`fetch.max.bytes` ≥ `message.max.bytes`, …) are checked here, at start, before
    /// anything listens, instead of failing the first consumer or producer later.
    fn validate_kafka_combination(&self) -> Result<(), ConfigError> {
        // Every client reads `[kafka]`, and processors often share one file: one name there
        // would be every processor's, and each start would fence the one before.
        if self.kafka.0.contains_key("group.instance.id") {
            return Err(ConfigError::Named {
                key: "key `kafka.group.instance.id` (JOBFOLD_KAFKA__GROUP_INSTANCE_ID)".into(),
                problem: "is each processor's own: set processor.group_instance_id \
                          (JOBFOLD_PROCESSOR__GROUP_INSTANCE_ID) per process instead"
                    .into(),
            });
        }
        for fixed in FIXED_KAFKA_OPTIONS {
            if let Some(value) = self.kafka.0.get(fixed.key)
                && !fixed.takes(value)
            {
                return Err(ConfigError::Named {
                    key: format!(
                        "key `kafka.{}` (JOBFOLD_KAFKA__{})",
                        fixed.key,
                        env_name(fixed.key)
                    ),
                    problem: format!(
                        "is fixed at {:?}, not {value:?}: {}; remove the setting",
                        fixed.value, fixed.why
                    ),
                });
            }
        }
        for role in [KafkaRole::Consumer, KafkaRole::Producer] {
            let mut client = rdkafka::ClientConfig::new();
            for fixed in FIXED_KAFKA_OPTIONS.iter().filter(|f| f.role == role) {
                client.set(fixed.key, fixed.value);
            }
            if role == KafkaRole::Consumer {
                client.set("group.id", &self.processor.group);
            }
            for (key, value) in &self.kafka.0 {
                client.set(key, value);
            }
            let created = match role {
                KafkaRole::Consumer => client
                    .create_with_context::<_, rdkafka::consumer::BaseConsumer<Quiet>>(Quiet)
                    .map(drop),
                KafkaRole::Producer => client
                    .create_with_context::<_, rdkafka::producer::BaseProducer<Quiet>>(Quiet)
                    .map(drop),
            };
            if let Err(e) = created {
                let problem = match e {
                    rdkafka::error::KafkaError::ClientCreation(message) => message,
                    other => other.to_string(),
                };
                let named: Vec<&str> = problem
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(|name| name.split('=').next().unwrap_or(name))
                    .collect();
                let key = if named.is_empty() {
                    "the `[kafka]` options together".to_owned()
                } else {
                    let keys: Vec<String> = named.iter().map(|k| format!("`kafka.{k}`")).collect();
                    let vars: Vec<String> =
                        named.iter().map(|k| format!("JOBFOLD_KAFKA__{}", env_name(k))).collect();
                    format!("keys {} ({})", keys.join(" and "), vars.join(", "))
                };
                return Err(ConfigError::Named {
                    key,
                    problem: format!("librdkafka refuses them together for a {role}: {problem}"),
                });
            }
        }
        Ok(())
    }

    /// librdkafka settings for a client: the brokers, then every `[kafka]` option.
    pub fn kafka_client(&self) -> rdkafka::ClientConfig {
        self.kafka_client_with(&[])
    }

    /// librdkafka settings for one of jobfold's consumers or producers: the brokers, the
    /// role's [`FIXED_KAFKA_OPTIONS`], the component's `defaults`, then every `[kafka]` option
    /// (which [`Config::validate`] holds to the fixed values).
    pub fn kafka_client_for(
        &self,
        role: KafkaRole,
        defaults: &[(&str, &str)],
    ) -> rdkafka::ClientConfig {
        let mut client = rdkafka::ClientConfig::new();
        client.set("bootstrap.servers", &self.kafka_brokers);
        for fixed in FIXED_KAFKA_OPTIONS.iter().filter(|f| f.role == role) {
            client.set(fixed.key, fixed.value);
        }
        for (key, value) in defaults {
            client.set(*key, *value);
        }
        for (key, value) in &self.kafka.0 {
            client.set(key, value);
        }
        client
    }

    /// librdkafka settings: the brokers, then a component's `defaults`, then every `[kafka]`
    /// option — so users can override any default.
    pub fn kafka_client_with(&self, defaults: &[(&str, &str)]) -> rdkafka::ClientConfig {
        let mut client = rdkafka::ClientConfig::new();
        client.set("bootstrap.servers", &self.kafka_brokers);
        for (key, value) in defaults {
            client.set(*key, *value);
        }
        for (key, value) in &self.kafka.0 {
            client.set(key, value);
        }
        client
    }
}

/// `d` as people write it, in days, hours, minutes, seconds and milliseconds, zero parts
/// left out: "365d", "1d 2h", "1m 30s", "250ms". Not in months or years, which have no
/// fixed length (365 days is not "11months 30days 3h 50m 24s").
pub fn span(d: Duration) -> String {
    let secs = d.as_secs();
    let parts = [
        (secs / 86_400, "d"),
        (secs / 3_600 % 24, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
        (u64::from(d.subsec_millis()), "ms"),
    ];
    let shown: Vec<String> =
        parts.iter().filter(|(n, _)| *n > 0).map(|(n, unit)| format!("{n}{unit}")).collect();
    if shown.is_empty() { "0s".to_owned() } else { shown.join(" ") }
}

/// Which client a librdkafka option is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaRole {
    /// The processors' and the intake's (and replay's) consumers.
    Consumer,
    /// The relay's and the dead-letter producer.
    Producer,
}

impl fmt::Display for KafkaRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Consumer => "consumer",
            Self::Producer => "producer",
        })
    }
}

/// A librdkafka option the guarantee rests on: `[kafka]` may repeat its value, never change it.
#[derive(Debug)]
pub struct FixedOption {
    pub key: &'static str,
    pub value: &'static str,
    /// Other spellings librdkafka takes for the same value (`acks=-1` is `all`).
    pub also: &'static [&'static str],
    pub role: KafkaRole,
    pub why: &'static str,
}

impl FixedOption {
    /// Whether `value` is this option's value, however spelt.
    pub fn takes(&self, value: &str) -> bool {
        let value = value.trim();
        value.eq_ignore_ascii_case(self.value)
            || self.also.iter().any(|also| value.eq_ignore_ascii_case(also))
    }
}

/// The librdkafka options jobfold sets and a `[kafka]` section may not change
/// (docs/kafka.md): each consumer and producer is built with these values.
pub const FIXED_KAFKA_OPTIONS: &[FixedOption] = &[
    FixedOption {
        key: "enable.auto.offset.store",
        value: "false",
        also: &[],
        role: KafkaRole::Consumer,
        why: "an offset is stored only once the job's outcome is committed in Postgres; \
              stored on receipt, a crash would skip the jobs not yet done",
    },
    FixedOption {
        key: "enable.auto.commit",
        value: "true",
        also: &[],
        role: KafkaRole::Consumer,
        why: "the offsets jobfold stored are committed by the client in the background; \
              without it they are committed only on a rebalance",
    },
    FixedOption {
        key: "auto.offset.reset",
        value: "earliest",
        also: &["smallest", "beginning"],
        role: KafkaRole::Consumer,
        why: "a new group, or one whose offsets expired, must start at the oldest event or \
              request, or accepted jobs are never run",
    },
    FixedOption {
        key: "isolation.level",
        value: "read_committed",
        also: &[],
        role: KafkaRole::Consumer,
        why: "a request an upstream producer's transaction aborted must not become a job",
    },
    FixedOption {
        key: "enable.idempotence",
        value: "true",
        also: &[],
        role: KafkaRole::Producer,
        why: "a retry across a leader change must not write an event twice or out of order",
    },
    FixedOption {
        key: "acks",
        value: "all",
        also: &["-1"],
        role: KafkaRole::Producer,
        why: "an event counts as published only once every in-sync replica has it",
    },
    FixedOption {
        key: "enable.gapless.guarantee",
        value: "true",
        also: &[],
        role: KafkaRole::Producer,
        why: "an event that fails must stop its partition, never be skipped by later events \
              of its document",
    },
    FixedOption {
        key: "message.timeout.ms",
        value: "0",
        also: &[],
        role: KafkaRole::Producer,
        why: "an event given up on after a time-out would leave a gap the next one skips over",
    },
];

/// A client context that drops librdkafka's log lines: the clients built only to check a
/// configuration ([`Config::validate`]) have nothing to say.
struct Quiet;

impl rdkafka::ClientContext for Quiet {
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, _: &str, _: &str) {}
}

impl rdkafka::consumer::ConsumerContext for Quiet {}

impl rdkafka::producer::ProducerContext for Quiet {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, (): ()) {}
}

/// The environment variable's spelling of a librdkafka option: `linger.ms` is `LINGER_MS`.
/// Kafka's rule for a `group.instance.id`: 1 to 249 of `[A-Za-z0-9._-]`.
fn check_group_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 249 {
        return Err(format!("must be 1 to 249 characters long, not {}", id.len()));
    }
    if let Some(c) =
        id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!("may hold only letters, digits, '.', '_' and '-', not {c:?}"));
    }
    Ok(())
}

fn env_name(option: &str) -> String {
    option.to_ascii_uppercase().replace('.', "_")
}

/// Every configuration key a `JOBFOLD_*` variable can set, spelt as a variable.
fn env_key_names() -> Vec<String> {
    use figment::value::Value;
    let defaults: BTreeMap<String, Value> =
        Figment::from(Toml::string(DEFAULTS)).extract().expect("the compiled-in defaults parse");
    let mut names = vec!["JOBFOLD_API_TOKEN".to_owned()];
    for (key, value) in &defaults {
        match value {
            Value::Dict(_, table) if key != "kafka" => names
                .extend(table.keys().map(|k| format!("JOBFOLD_{key}__{k}").to_ascii_uppercase())),
            Value::Dict(..) => {}
            _ => names.push(format!("JOBFOLD_{key}").to_ascii_uppercase()),
        }
    }
    names
}

/// Refuses a `JOBFOLD_*` variable that names no configuration key (a misspelling would
/// otherwise be ignored without a word), naming the nearest valid one.
fn check_env_names(variables: impl Iterator<Item = String>) -> Result<(), ConfigError> {
    let mut known: Option<Vec<String>> = None;
    for variable in variables {
        let Some(rest) = variable.strip_prefix("JOBFOLD_") else { continue };
        if NOT_CONFIG.contains(&variable.as_str())
            || rest.starts_with("KAFKA__")
            || fault_points(&variable)
        {
            continue;
        }
        let top = rest.split("__").next().unwrap_or_default().to_ascii_lowercase();
        if ENV_KEYS.contains(&top.as_str()) {
            // A known section: figment names a misspelt key inside it (unknown field).
            continue;
        }
        let known = known.get_or_insert_with(env_key_names);
        let nearest =
            known.iter().min_by_key(|k| strsim::levenshtein(k, &variable)).expect("there are keys");
        return Err(ConfigError::Named {
            key: format!("environment variable {variable}"),
            problem: format!("names no configuration key; did you mean {nearest}?"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Config {
        Figment::from(Toml::string(DEFAULTS)).extract().expect("the defaults load")
    }

    fn problem(result: Result<(), ConfigError>) -> String {
        result.expect_err("refused").to_string()
    }

    #[test]
    fn a_misspelt_variable_is_refused_naming_the_nearest_key() {
        let refused = problem(check_env_names(["JOBFOLD_DATABSE_URL".to_owned()].into_iter()));
        assert!(refused.contains("JOBFOLD_DATABSE_URL"), "{refused}");
        assert!(refused.contains("did you mean JOBFOLD_DATABASE_URL?"), "{refused}");
        let refused = problem(check_env_names(["JOBFOLD_RELAY_BATCH_SIZE".to_owned()].into_iter()));
        assert!(refused.contains("JOBFOLD_RELAY__BATCH_SIZE"), "{refused}");
        let fine = [
            "JOBFOLD_STATE_DIR",
            "JOBFOLD_KAFKA__LINGER_MS",
            "JOBFOLD_RELAY__BATCH_SIZE",
            "JOBFOLD_DATABASE_URL",
            "PATH",
        ];
        assert!(check_env_names(fine.iter().map(|s| (*s).to_owned())).is_ok());
    }

    #[test]
    fn a_misspelt_key_inside_a_section_names_the_nearest_one() {
        let extracted = Figment::from(Toml::string(DEFAULTS))
            .merge(Toml::string("[processor]\nleasettl = \"5s\""))
            .extract::<Config>()
            .expect_err("refused");
        let refused = ConfigError::Load(Box::new(extracted)).to_string();
        assert!(refused.contains("processor.leasettl"), "{refused}");
        assert!(
            refused.contains("did you mean processor.lease_ttl (JOBFOLD_PROCESSOR__LEASE_TTL)?"),
            "{refused}"
        );
        assert!(!refused.contains("``"), "{refused}");
    }

    #[test]
    fn a_toml_syntax_error_names_the_file() {
        let path = std::env::temp_dir().join(format!("jobfold-{}.toml", std::process::id()));
        std::fs::write(&path, "[relay\nbatch_size = 5\n").unwrap();
        let refused = Config::load(Some(&path)).expect_err("refused").to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(refused.contains(&path.display().to_string()), "{refused}");
        assert!(refused.contains("not valid TOML"), "{refused}");
    }

    #[test]
    fn registry_credentials_are_settings_of_their_own_and_never_shown() {
        use jobfold_schemas::RegistryAuth;
        let mut config = defaults();
        config.schema_registry_url =
            SecretUrl::new("https://svc:p%40ss@registry.example:8443/apis/ccompat/v7");
        let (bare, credentials) = config.schema_registry_url.split_credentials();
        assert_eq!(bare, "https://registry.example:8443/apis/ccompat/v7");
        assert_eq!(credentials, Some(("svc".into(), Some("p@ss".into()))));
        assert_eq!(
            config.registry_auth(),
            RegistryAuth::Basic { username: "svc".into(), password: Some("p@ss".into()) }
        );
        let shown = [
            format!("{config:?}"),
            config.schema_registry_url.to_string(),
            serde_json::to_string(&config).unwrap(),
        ];
        for shown in shown {
            assert!(!shown.contains("p@ss") && !shown.contains("p%40ss"), "{shown}");
            assert!(!shown.contains("svc"), "{shown}");
            assert!(shown.contains("registry.example:8443"), "{shown}");
        }
        assert!(config.validate().is_ok());
        // One that does not parse (a port out of range) shows no credentials either.
        let broken = SecretUrl::new("https://svc:p@ss@registry.example:99999/apis");
        assert_eq!(broken.to_string(), "https://*********@registry.example:99999/apis");

        // The same credentials as settings; the token instead.
        config.schema_registry_username = Some("svc".into());
        assert!(problem(config.validate()).contains("schema_registry_username"));
        config.schema_registry_url = SecretUrl::new("https://registry.example/apis/ccompat/v7");
        config.schema_registry_password = Some(Sensitive::new("p@ss".into()));
        assert!(config.validate().is_ok());
        assert!(!format!("{config:?}").contains("p@ss"));
        config.schema_registry_token = Some(Sensitive::new("t0ken".into()));
        assert!(problem(config.validate()).contains("schema_registry_token"));
        config.schema_registry_username = None;
        assert!(problem(config.validate()).contains("schema_registry_password"));
        config.schema_registry_password = None;
        assert!(config.validate().is_ok());
        assert_eq!(config.registry_auth(), RegistryAuth::Bearer("t0ken".into()));
        assert!(!format!("{config:?} {:?}", config.registry_auth()).contains("t0ken"));
    }

    #[test]
    fn a_kinds_url_shows_neither_its_credentials_nor_its_query_values() {
        let mut config = defaults();
        let url = "https://bot:hunter2@worker.example/run?api_key=s3cret&region=eu#frag";
        config
            .kinds
            .insert("remote".into(), Kind { url: Some(SecretUrl::new(url)), ..Kind::default() });
        assert!(config.validate().is_ok());
        let shown = [format!("{config:?}"), serde_json::to_string(&config).unwrap()];
        for shown in shown {
            for secret in ["hunter2", "bot:", "s3cret", "=eu"] {
                assert!(!shown.contains(secret), "{secret} in {shown}");
            }
            assert!(
                shown.contains("worker.example/run?api_key=*********&region=*********"),
                "{shown}"
            );
        }
        assert_eq!(redacted("http://h/p?flag"), "http://h/p?flag");
        assert_eq!(redacted("http://u:p@h/p"), "http://*********@h/p");
    }

    #[test]
    fn http_access_settings_are_checked_naming_the_key() {
        let mut config = defaults();
        config.http.allowed_hosts = vec!["jobs.internal".into(), "*.example.com:443".into()];
        config.http.tokens =
            vec![ApiToken { name: "dashboards".into(), role: Role::Read, sha256: "a".repeat(64) }];
        assert!(config.validate().is_ok());
        config.http.allowed_hosts.push("bad host/".into());
        assert!(problem(config.validate()).contains("http.allowed_hosts[2]"));
        config.http.allowed_hosts.pop();
        config.http.tokens[0].sha256 = "secret-in-the-clear".into();
        assert!(problem(config.validate()).contains("http.tokens[0].sha256"));
        config.http.tokens[0].sha256 = "b".repeat(64);
        let shown = format!("{config:?} {}", serde_json::to_string(&config).unwrap());
        assert!(shown.contains("dashboards") && !shown.contains(&"b".repeat(64)), "{shown}");
        config.http.tokens.push(config.http.tokens[0].clone());
        assert!(problem(config.validate()).contains("http.tokens[1].name"));
        config.http.tokens.pop();
        config.http.auth_failures_per_minute = 0;
        assert!(problem(config.validate()).contains("http.auth_failures_per_minute"));
        config.http.auth_failures_per_minute = 10;
        config.http.request_timeout = config.accept.commit_timeout;
        assert!(problem(config.validate()).contains("http.request_timeout"));
        config.http.request_timeout = Duration::from_secs(30);
        config.http.max_concurrent_requests = 0;
        assert!(problem(config.validate()).contains("http.max_concurrent_requests"));
    }

    #[test]
    fn spans_are_shown_in_days_never_months() {
        assert_eq!(span(Duration::from_secs(365 * 86_400)), "365d");
        assert_eq!(span(Duration::from_secs(86_400 + 2 * 3_600 + 5)), "1d 2h 5s");
        assert_eq!(span(Duration::from_millis(1_250)), "1s 250ms");
        assert_eq!(span(Duration::ZERO), "0s");
    }

    #[test]
    fn the_guarantees_librdkafka_options_cannot_be_changed() {
        for (key, value) in [
            ("enable.auto.offset.store", "true"),
            ("enable.auto.commit", "false"),
            ("auto.offset.reset", "latest"),
            ("isolation.level", "read_uncommitted"),
            ("enable.idempotence", "false"),
            ("acks", "1"),
            ("enable.gapless.guarantee", "false"),
            ("message.timeout.ms", "30000"),
        ] {
            let mut config = defaults();
            config.kafka.0.insert(key.into(), value.into());
            let refused = problem(config.validate());
            assert!(
                refused.contains(&format!("kafka.{key}")) && refused.contains("is fixed at"),
                "{key}: {refused}"
            );
        }
        // Repeating jobfold's value, however spelt, is no change.
        let mut config = defaults();
        config.kafka.0.insert("acks".into(), "-1".into());
        config.kafka.0.insert("enable.idempotence".into(), "true".into());
        assert!(config.validate().is_ok());
        // Every fixed option is one librdkafka takes for its role.
        for fixed in FIXED_KAFKA_OPTIONS {
            assert!(fixed.takes(fixed.value));
        }
    }

    #[test]
    fn a_group_instance_id_is_each_processors_own_and_as_kafka_takes_it() {
        let mut config = defaults();
        config.processor.group_instance_id = Some("processor-0.jobfold_a".into());
        assert!(config.validate().is_ok());
        for (id, says) in [
            ("", "1 to 249"),
            ("p 1", "not ' '"),
            ("p/1", "not '/'"),
            (&"p".repeat(250), "not 250"),
        ] {
            config.processor.group_instance_id = Some(id.to_owned());
            let refused = problem(config.validate());
            assert!(
                refused.contains("processor.group_instance_id") && refused.contains(says),
                "{id:?}: {refused}"
            );
        }
        // In `[kafka]` it would be every processor's that shares the file.
        let mut config = defaults();
        config.kafka.0.insert("group.instance.id".into(), "p1".into());
        let refused = problem(config.validate());
        assert!(
            refused.contains("kafka.group.instance.id")
                && refused.contains("JOBFOLD_PROCESSOR__GROUP_INSTANCE_ID"),
            "{refused}"
        );
    }

    #[test]
    fn options_librdkafka_refuses_together_are_named_both() {
        let mut config = defaults();
        config.kafka.0.insert("message.max.bytes".into(), "4000000".into());
        config.kafka.0.insert("fetch.max.bytes".into(), "1048576".into());
        let refused = problem(config.validate());
        assert!(
            refused.contains("`kafka.fetch.max.bytes`")
                && refused.contains("`kafka.message.max.bytes`")
                && refused.contains("JOBFOLD_KAFKA__FETCH_MAX_BYTES"),
            "{refused}"
        );
        let mut config = defaults();
        config.kafka.0.insert("max.in.flight".into(), "10".into());
        let refused = problem(config.validate());
        assert!(
            refused.contains("kafka.max.in.flight") && refused.contains("producer"),
            "{refused}"
        );
        // Raised alone, message.max.bytes is fine: librdkafka raises its fetch size with it.
        let mut config = defaults();
        config.kafka.0.insert("message.max.bytes".into(), "4000000".into());
        assert!(config.validate().is_ok());
    }

    #[test]
    fn a_librdkafka_option_it_does_not_take_is_refused_naming_it() {
        let mut config = defaults();
        config.kafka.0.insert("linger.mss".into(), "5".into());
        let refused = problem(config.validate());
        assert!(
            refused.contains("kafka.linger.mss") && refused.contains("LINGER_MSS"),
            "{refused}"
        );
        let mut config = defaults();
        config.kafka.0.insert("sasl.password".into(), "hunter2".into());
        config.kafka.0.insert("linger.ms".into(), "soon".into());
        let refused = problem(config.validate());
        assert!(refused.contains("kafka.linger.ms"), "{refused}");
        assert!(!refused.contains("hunter2"));
    }

    #[test]
    fn retention_is_off_by_default_and_its_bounds_name_their_key() {
        let mut config = defaults();
        assert!(config.retention.sweeps().is_empty(), "nothing is deleted by default");
        config.retention.job_events_after = Some(Duration::from_secs(3600));
        config.retention.jobs_after = Some(Duration::from_secs(60));
        let refused = problem(config.validate());
        assert!(refused.contains("retention.jobs_after"), "{refused}");
        assert!(refused.contains("retention.job_events_after"), "{refused}");
        config.retention.jobs_after = Some(Duration::from_secs(7200));
        assert!(config.validate().is_ok());
        config.retention.job_results_after = Some(Duration::from_millis(10));
        assert!(problem(config.validate()).contains("retention.job_results_after"));
        let mut config = defaults();
        config.processor.max_buffered = 0;
        assert!(problem(config.validate()).contains("processor.max_buffered"));
    }

    #[test]
    fn the_accept_batches_are_bounded_naming_the_key() {
        let mut config = defaults();
        for bad in [0, 10_001] {
            config.intake.max_batch = bad;
            assert!(problem(config.validate()).contains("intake.max_batch"));
        }
        config.intake.max_batch = 10_000;
        assert!(config.validate().is_ok());
        config.accept.max_batch_bytes = config.accept.max_input_bytes - 1;
        assert!(problem(config.validate()).contains("accept.max_batch_bytes"));
        config.accept.max_batch_bytes = (1 << 30) + 1;
        assert!(problem(config.validate()).contains("accept.max_batch_bytes"));
        config.accept.max_batch_bytes = config.accept.max_input_bytes;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn the_graceful_stop_is_bounded_naming_the_key() {
        let mut config = defaults();
        assert_eq!(config.processor.shutdown_timeout, Duration::from_secs(25));
        config.processor.shutdown_timeout = Duration::from_secs(3601);
        assert!(problem(config.validate()).contains("processor.shutdown_timeout"));
        // Zero: running handlers are cancelled and given back at once.
        config.processor.shutdown_timeout = Duration::ZERO;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn a_periodic_schedule_is_checked_naming_its_key() {
        let mut config = defaults();
        let good = Periodic {
            kind: "noop".into(),
            cron: "*/5 * * * * *".into(),
            time_zone: "Europe/Paris".into(),
            input: Some(serde_json::json!({ "a": 1 })),
            catch_up: Duration::from_secs(60),
            missed: Missed::RunOnce,
        };
        config.periodic.insert("every-5s".into(), good.clone());
        assert!(config.validate().is_ok());
        for (broken, key) in [
            (Periodic { cron: "61 * * * *".into(), ..good.clone() }, "periodic.every-5s.cron"),
            (
                Periodic { time_zone: "Mars/Olympus".into(), ..good.clone() },
                "periodic.every-5s.time_zone",
            ),
            (Periodic { kind: " ".into(), ..good.clone() }, "periodic.every-5s.kind"),
            (Periodic { catch_up: Duration::ZERO, ..good.clone() }, "periodic.every-5s.catch_up"),
            (
                Periodic { catch_up: Duration::from_secs(3601), ..good.clone() },
                "periodic.every-5s.catch_up",
            ),
        ] {
            config.periodic.insert("every-5s".into(), broken);
            assert!(problem(config.validate()).contains(key), "{key}");
        }
        config.periodic.clear();
        config.periodic.insert("a/b".into(), good);
        assert!(problem(config.validate()).contains("periodic.a/b"));
    }

    #[test]
    fn each_kind_falls_back_to_the_global_settings_and_is_checked_like_them() {
        let mut config = defaults();
        config.kinds.insert(
            "slow".into(),
            Kind {
                lease_ttl: Some(Duration::from_secs(120)),
                max_attempts: Some(9),
                ..Kind::default()
            },
        );
        let slow = config.kind("slow");
        assert_eq!(slow.lease_ttl, Duration::from_secs(120));
        assert_eq!(slow.heartbeat, config.processor.heartbeat);
        assert_eq!(slow.max_attempts, 9);
        assert_eq!(slow.owner, config.processor.default_owner);
        assert_eq!(config.accept_policy().budget("slow").0, 9);
        assert_eq!(config.accept_policy().budget("other").0, config.accept.default_max_attempts);
        assert!(config.validate().is_ok());

        for (kind, key) in [
            (Kind { heartbeat: Some(Duration::from_secs(40)), ..Kind::default() }, "heartbeat"),
            (Kind { concurrency: Some(0), ..Kind::default() }, "concurrency"),
            (Kind { request_timeout: Some(Duration::ZERO), ..Kind::default() }, "request_timeout"),
            (Kind { max_retry_after: Some(Duration::ZERO), ..Kind::default() }, "max_retry_after"),
            (Kind { max_crashes: Some(0), ..Kind::default() }, "max_crashes"),
            (
                Kind { crash_backoff: Some(Duration::from_secs(7200)), ..Kind::default() },
                "crash_backoff",
            ),
            (Kind { max_snoozes: Some(-1), ..Kind::default() }, "max_snoozes"),
            (Kind { retry_base: Some(Duration::from_secs(3600)), ..Kind::default() }, "retry_base"),
            (Kind { max_attempts: Some(0), ..Kind::default() }, "max_attempts"),
            (Kind { url: Some(SecretUrl::new("ftp://host/run")), ..Kind::default() }, "url"),
            (Kind { url: Some(SecretUrl::new("not a url")), ..Kind::default() }, "url"),
            (Kind { rate_per_second: Some(0.0), ..Kind::default() }, "rate_per_second"),
            (Kind { rate_per_second: Some(f64::NAN), ..Kind::default() }, "rate_per_second"),
            (Kind { cost_per_minute: Some(-5.0), ..Kind::default() }, "cost_per_minute"),
            (Kind { cost_pointer: Some("tokens".into()), ..Kind::default() }, "cost_pointer"),
            (Kind { secret: Some(Sensitive::new("short".into())), ..Kind::default() }, "secret"),
            (
                Kind { callback_timeout: Some(Duration::ZERO), ..Kind::default() },
                "callback_timeout",
            ),
            (Kind { ca_file: Some("/nonexistent/ca.pem".into()), ..Kind::default() }, "ca_file"),
            (Kind { ca_file: Some("/etc/hostname".into()), ..Kind::default() }, "ca_file"),
        ] {
            let mut config = defaults();
            config.kinds.insert("bad".into(), kind);
            let refused = problem(config.validate());
            assert!(refused.contains(&format!("kinds.bad.{key}")), "{refused}");
        }
    }
}
