//! The fault campaign: the whole system under load while faults land anywhere, any time —
//! then the [`crate::history`] checker.
//!
//! It starts its own Postgres, Kafka and registry (the `docker/` scripts, on ports and a
//! state directory of its own, so its crashes touch nothing else), 2 relays and 2–3
//! processors as OS processes, and three producers at once: the HTTP API, the intake topic
//! and the Rust API, with several versions per document and shares of transient failures,
//! invalid inputs and slow jobs. Meanwhile it injects, at seeded random times:
//!
//! - `kill-processor`, `kill-relay`: SIGKILL at a random moment; the replacement may start
//!   with a random failpoint armed (it then aborts itself at that crash window: counted as
//!   `failpoint <name>`);
//! - `pause-processor`: SIGSTOP past its lease expiry, then SIGCONT (a zombie worker);
//! - `restart-kafka`: SIGKILL of the broker, restart;
//! - on a three-broker cluster ([`Plan::brokers`] = 3), every second fault instead: SIGKILL of the leader of the
//!   busiest events partition, of the processors' group coordinator or of the active
//!   controller, each restarted; a broker paused past its session; a rolling restart of all
//!   three; two brokers down at once (under `min.insync.replicas`) — see `broker_fault`;
//! - `restart-postgres`: immediate-mode stop (no checkpoint) and restart; on a primary with a
//!   synchronous standby ([`Plan::pg_nodes`] = 2) instead: kill -9 of the primary and the
//!   standby's promotion (the old primary rejoining as the new one's standby 0.5–3 s later;
//!   dealt once a run at least), a planned switchover, or the standby killed for 1–4 s
//!   (every commit waits for it meanwhile) — see `postgres_fault`;
//! - `add-processor`, `remove-processor`: consumer group rebalances;
//! - `rolling-restart`: every processor in turn stopped with SIGTERM (its running jobs finish
//!   within `processor.shutdown_timeout` or are given back) and replaced, as a deploy does;
//! - `pause-resume`: once a run, after the broker's refusal, an operator pauses the test
//!   kind for 1–6 s (its dispatches passed over, noted), then resumes it (the noted jobs
//!   dispatched again).
//!
//! A fourth producer mixes in bad jobs ([`crate::bad`]) at random times: results over the
//! size limit, inputs holding U+0000 on every path, malformed and unknown-schema intake
//! frames, handlers that panic (in `run`, `commit` or `cost`), hang, ignore their token or
//! abort their process, errors of every class, unregistered kinds, one document with
//! hundreds of versions at once, operator replays, and over HTTP (`remote-bad`) a
//! `Retry-After` of 3,000 years, `503` snoozes, a redirect and a handler that never
//! answers. Meanwhile it watches the relay's cursor.
//!
//! Then it lets the system drain, checks the history and stops everything it started.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use jobfold_common::accept::NewJob;
use jobfold_common::config::{Config, Sensitive};
use jobfold_common::failpoint;
use jobfold_schemas::{Codec, JobRequest};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{Service, free_port};
use crate::history::{self, Acknowledged, History};

/// The fault a deploy is: every processor stopped gracefully in turn and replaced.
const ROLLING_RESTART: &str = "rolling restart of the processors (SIGTERM each, replaced)";

/// How long a stopped process is given to exit before kill -9 (a deploy's grace period).
const STOP_GRACE: Duration = Duration::from_secs(20);
/// The fault an operator's pause is: the test kind paused in every processor for a few
/// seconds, then resumed.
const PAUSE_RESUME: &str = "the kind paused for seconds, then resumed (operator)";

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    /// Faults to inject (failpoints that fire on their own come on top).
    pub faults: usize,
    /// Pause between faults, in milliseconds, drawn uniformly.
    pub gap_ms: (u64, u64),
    /// Jobs each producer submits per second.
    pub rate: f64,
    /// Port base: Postgres on base+1, Kafka on base+2..4 (a cluster's node n 10n above),
    /// the registry on base+5.
    pub port_base: u16,
    /// Time to drain after the last fault.
    pub drain_timeout: Duration,
    /// Bad jobs, as a share of all the jobs submitted.
    pub bad_share: f64,
    /// Versions of the one busy document.
    pub hot_versions: usize,
    /// How long a well-behaved job may be open, an acknowledged intake request wait to be
    /// accepted, or the relay's cursor stand still while events wait, outside the faults'
    /// windows: what the load alone costs (a document's versions queued one behind the other,
    /// the slowest run, a retry), well under what a bad job holding others up would.
    pub delay_bound: Duration,
    /// How long after it lands a fault may hold work up: a broker restart, then the group's
    /// session time-out and rebalance, a lease running out.
    pub fault_window: Duration,
    /// The quiet stretch's length after the busy document comes (it comes one
    /// `fault_window` after the last fault before it).
    pub quiet: Duration,
    /// Kafka brokers: 1, or 3 (a KRaft cluster, topics with three replicas and
    /// `min.insync.replicas=2`, and broker faults instead of the one broker's restart).
    pub brokers: u8,
    /// Postgres servers: 1, or 2 (a primary and a synchronous standby, the binaries given
    /// both hosts and `database.require_sync_standby`, and failovers, switchovers and the
    /// standby's loss instead of the one server's restart).
    pub pg_nodes: u8,
    /// On a Postgres pair, a failover every this many faults besides the random ones (a long
    /// run that must count many); once a run at least, a third of the way in, without it.
    pub failover_every: Option<usize>,
}

impl Plan {
    /// The CI size: about 20 faults in a few minutes.
    pub fn short(seed: u64) -> Self {
        Self {
            seed,
            faults: 20,
            gap_ms: (500, 2500),
            rate: 5.0,
            port_base: 25_400,
            drain_timeout: Duration::from_secs(180),
            bad_share: 0.1,
            hot_versions: 300,
            delay_bound: Duration::from_secs(15),
            fault_window: Duration::from_secs(25),
            quiet: Duration::from_secs(30),
            brokers: 1,
            pg_nodes: 2,
            failover_every: None,
        }
    }

    /// The CI size on a three-broker cluster, on ports of its own: 12 faults, 6 of them on
    /// Kafka (a broker's restart takes about 10 s: its old session must expire first).
    pub fn short_cluster(seed: u64) -> Self {
        Self::cluster(seed, 12)
    }

    /// `faults` faults on a three-broker cluster. A fault's window is 45 s: two brokers down
    /// at once stop everything for their 1–8 s plus a restart of about 10 s, and the jobs
    /// that piled up meanwhile (15 a second) take the rest to work off on two cores (a first
    /// 100-fault run measured up to 42 s after such a restart with a 25 s window).
    pub fn cluster(seed: u64, faults: usize) -> Self {
        Self {
            brokers: 3,
            pg_nodes: 1,
            port_base: 25_500,
            faults,
            fault_window: Duration::from_secs(45),
            ..Self::short(seed)
        }
    }

    /// The long run: `faults` faults.
    pub fn long(seed: u64, faults: usize) -> Self {
        Self { faults, ..Self::short(seed) }
    }
}

/// What happened, and the checker's verdict.
#[derive(Debug, Default)]
pub struct Outcome {
    pub seed: u64,
    /// Per outage under `min.insync.replicas`: the relay's backlog gauge at its highest, and
    /// the unpublished events in Postgres at their most.
    pub under_min_isr: Vec<(f64, i64)>,
    pub faults: BTreeMap<String, u64>,
    pub duplicates_skipped: u64,
    pub fenced_completions: u64,
    pub handler_runs: u64,
    pub intake_duplicates: u64,
    pub elapsed: Duration,
    pub history: History,
    pub ledger: crate::bad::Ledger,
}

impl Outcome {
    /// No finding, and duplicates were delivered (a run without any proves nothing).
    pub fn held(&self) -> bool {
        self.history.findings.is_empty() && self.duplicates_delivered() > 0
    }

    pub fn duplicates_delivered(&self) -> u64 {
        self.history.duplicates_on_topic + self.duplicates_skipped + self.intake_duplicates
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let injected: u64 = self.faults.values().sum();
        writeln!(
            f,
            "campaign seed {} — {injected} faults in {:.0} s",
            self.seed,
            self.elapsed.as_secs_f64()
        )?;
        for (kind, n) in &self.faults {
            writeln!(f, "  {kind:<48} {n:>5}")?;
        }
        writeln!(
            f,
            "duplicates: {} on the topic, {} dispatches skipped by the processors, {} intake requests skipped",
            self.history.duplicates_on_topic, self.duplicates_skipped, self.intake_duplicates
        )?;
        writeln!(
            f,
            "fenced completions {}, handler runs {} for {} business writes",
            self.fenced_completions, self.handler_runs, self.history.business_writes
        )?;
        for (gauge, waiting) in &self.under_min_isr {
            writeln!(
                f,
                "under min.insync.replicas: {waiting} events waited at most, the relay's backlog gauge showed {gauge:.0}"
            )?;
        }
        write!(f, "{}", self.history)?;
        if !self.history.bad.is_empty() {
            writeln!(
                f,
                "bad jobs (submitted / ended as documented), {} operator replays:",
                self.ledger.replays
            )?;
            for (kind, (submitted, documented)) in &self.history.bad {
                writeln!(f, "  {kind:<48} {submitted:>5} {documented:>5}")?;
            }
        }
        if self.duplicates_delivered() == 0 {
            writeln!(f, "FINDING: no duplicate was delivered: this run proves nothing about them")?;
        }
        if !self.held() {
            writeln!(
                f,
                "rerun: cargo run -p jobfold-tests --bin jobfold-campaign -- --seed {}{}",
                self.seed,
                if crate::harness::profile() == "release" { " --release" } else { "" }
            )?;
        }
        Ok(())
    }
}

/// The campaign's own services.
struct Services {
    root: PathBuf,
    env: Vec<(String, String)>,
    /// Postgres runs as a primary and a synchronous standby.
    pg_pair: bool,
}

impl Services {
    fn new(plan: &Plan) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let b = plan.port_base;
        let state = std::env::temp_dir().join(format!(
            "jobfold-campaign-{}-{}",
            plan.seed,
            std::process::id()
        ));
        let env = vec![
            ("JOBFOLD_STATE_DIR".into(), state.display().to_string()),
            ("JOBFOLD_PG_PORT".into(), (b + 1).to_string()),
            ("JOBFOLD_KAFKA_PORT".into(), (b + 2).to_string()),
            ("JOBFOLD_KAFKA_CONTROLLER_PORT".into(), (b + 3).to_string()),
            ("JOBFOLD_KAFKA_SASL_PORT".into(), (b + 4).to_string()),
            ("JOBFOLD_REGISTRY_PORT".into(), (b + 5).to_string()),
            // Node n of a cluster listens 10n ports above these (docker/kafka.sh), as a
            // Postgres pair's node n does (docker/postgres.sh).
            ("JOBFOLD_KAFKA_NODES".into(), plan.brokers.to_string()),
            ("JOBFOLD_PG_NODES".into(), plan.pg_nodes.to_string()),
        ];
        Self { root, env, pg_pair: plan.pg_nodes == 2 }
    }

    fn script(&self, service: &str, action: &str) -> anyhow::Result<()> {
        let output = std::process::Command::new("bash")
            .arg(self.root.join(format!("docker/{service}.sh")))
            .arg(action)
            .envs(self.env.iter().cloned())
            .stdin(std::process::Stdio::null())
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "docker/{service}.sh {action} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    /// `docker/<service>.sh args...` without holding a runtime thread; its standard output.
    async fn run(&self, service: &str, args: &[&str]) -> anyhow::Result<String> {
        let output = tokio::process::Command::new("bash")
            .arg(self.root.join(format!("docker/{service}.sh")))
            .args(args)
            .envs(self.env.iter().cloned())
            .stdin(std::process::Stdio::null())
            .output()
            .await?;
        anyhow::ensure!(
            output.status.success(),
            "docker/{service}.sh {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn port(&self, n: u16) -> u16 {
        self.env[1].1.parse::<u16>().expect("a port") - 1 + n
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        // Left running for a look at the history (the state directory is printed).
        if std::env::var_os("CAMPAIGN_KEEP_SERVICES").is_some() {
            eprintln!("services kept running: {:?}", self.env);
            return;
        }
        for service in ["registry", "kafka", "postgres"] {
            let _ = self.script(service, "stop");
        }
        let _ = std::fs::remove_dir_all(&self.env[0].1);
    }
}

/// One relay or processor slot: its running process, and the counters of the ones before.
struct Slot {
    binary: &'static str,
    service: Option<Service>,
    http: u16,
    armed: Option<String>,
    /// A processor's `processor.group_instance_id`, its replacement's too.
    name: Option<String>,
    paused_until: Option<Instant>,
    last: BTreeMap<&'static str, f64>,
}

const COUNTERS: [&str; 4] = [
    "jobfold_duplicates_skipped_total",
    "jobfold_fenced_completions_total",
    "jobfold_handler_runs_total",
    "jobfold_intake_duplicates_total",
];

const PROCESSOR_FAILPOINTS: [&str; 4] = [
    failpoint::PROCESSOR_AFTER_LEASE_COMMIT,
    failpoint::PROCESSOR_IN_HANDLER,
    failpoint::PROCESSOR_AFTER_COMPLETION_BEFORE_OFFSET,
    failpoint::INTAKE_AFTER_COMMIT_BEFORE_OFFSET,
];

struct Fleet {
    env: std::collections::HashMap<String, String>,
    slots: Vec<Slot>,
    banked: BTreeMap<&'static str, f64>,
    faults: BTreeMap<String, u64>,
    /// Every fault as it landed, for the checker's account of a slow job.
    timeline: Vec<(chrono::DateTime<chrono::Utc>, String)>,
    /// When the fault being injected began (a restart's time counts in its window).
    landing: Option<chrono::DateTime<chrono::Utc>>,
    /// See [`Outcome::under_min_isr`].
    under_min_isr: Vec<(f64, i64)>,
    ports: Arc<Mutex<Vec<u16>>>,
    /// Processors that died under the campaign (killed, a fail point, a bad job's abort),
    /// by pid: a job running alone in one when it died is charged a crash it may not have
    /// caused ([`history::Observed::deaths`]).
    deaths: std::collections::HashSet<u32>,
    /// Processor names given so far.
    named: usize,
}

impl Fleet {
    /// Kills slot `i`'s process with SIGKILL (counted among the deaths if a processor's).
    fn kill9(&mut self, i: usize) {
        if let Some(mut s) = self.slots[i].service.take() {
            if self.slots[i].binary == "jobfold-test-processor" {
                self.deaths.insert(s.pid());
            }
            s.kill9();
        }
    }

    /// Stops slot `i`'s process as a deploy does: SIGTERM, then, as a deploy's grace period
    /// ends, kill -9 if it has not exited within [`STOP_GRACE`]. A stop can outlast it when
    /// the faults hold Postgres's commits (a primary waiting for its standby), and the jobs
    /// it ran are then charged a crash: a death the campaign caused, counted and explained
    /// from the process's log.
    fn terminate(&mut self, i: usize) {
        self.bank(i);
        let binary = self.slots[i].binary;
        if let Some(mut s) = self.slots[i].service.take() {
            s.signal("TERM");
            let stopped = s.wait_exit(STOP_GRACE);
            if let Some(status) = stopped.filter(|status| !status.success()) {
                // It had died on its own (a failpoint, a bad job's abort) before it was told
                // to stop, or while stopping: what it ran was lost with it, as in any death
                // of the campaign's making, which `tend` would have counted had it looked
                // first.
                let pid = s.pid();
                if binary == "jobfold-test-processor" {
                    self.deaths.insert(pid);
                }
                eprintln!(
                    "campaign: {binary} (pid {pid}) ended by itself ({status}) as it was \
                     stopped; its log ends:\n  {}",
                    exit_reason(&s.log_text()).join("\n  ")
                );
            }
            if stopped.is_none() {
                let pid = s.pid();
                if binary == "jobfold-test-processor" {
                    self.deaths.insert(pid);
                }
                s.kill9();
                eprintln!(
                    "campaign: {binary} (pid {pid}) was still stopping {STOP_GRACE:?} after \
                     SIGTERM and was killed; its log ends:\n  {}",
                    exit_reason(&s.log_text()).join("\n  ")
                );
                // Counted at its own time; the start of the fault it happens in (a deploy,
                // a removal) stays that fault's.
                let landing = self.landing.take();
                self.count(format!(
                    "{binary} still stopping {STOP_GRACE:?} after SIGTERM: kill -9"
                ));
                self.landing = landing;
            }
        }
    }

    /// Starts `binary` in a new slot; a processor under a name of its own in the group.
    fn start(&mut self, binary: &'static str, armed: Option<String>) -> usize {
        let name = (binary == "jobfold-test-processor").then(|| {
            self.named += 1;
            format!("campaign-processor-{}", self.named)
        });
        self.start_as(binary, armed, name)
    }

    /// Starts `binary` in a new slot, a processor as `name` in the group (static
    /// membership, as a StatefulSet's pods run: a restart under the same name takes the
    /// partitions back without a rebalance).
    fn start_as(
        &mut self,
        binary: &'static str,
        armed: Option<String>,
        name: Option<String>,
    ) -> usize {
        let http = free_port();
        let mut env = self.env.clone();
        env.insert("JOBFOLD_HTTP_ADDR".into(), format!("127.0.0.1:{http}"));
        if let Some(armed) = &armed {
            env.insert("JOBFOLD_FAILPOINT".into(), armed.clone());
        }
        if let Some(name) = &name {
            env.insert("JOBFOLD_PROCESSOR__GROUP_INSTANCE_ID".into(), name.clone());
        }
        let service = Service::start(binary, &env);
        self.slots.push(Slot {
            binary,
            service: Some(service),
            http,
            armed,
            name,
            paused_until: None,
            last: BTreeMap::new(),
        });
        self.publish_ports();
        self.slots.len() - 1
    }

    fn publish_ports(&self) {
        let ports = self
            .slots
            .iter()
            .filter(|s| {
                s.binary == "jobfold-test-processor"
                    && s.service.is_some()
                    && s.paused_until.is_none()
            })
            .map(|s| s.http)
            .collect();
        *self.ports.lock().expect("ports") = ports;
    }

    fn live(&self, binary: &str) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|i| {
                let s = &self.slots[*i];
                s.binary == binary && s.service.is_some() && s.paused_until.is_none()
            })
            .collect()
    }

    fn bank(&mut self, i: usize) {
        for (name, value) in std::mem::take(&mut self.slots[i].last) {
            *self.banked.entry(name).or_default() += value;
        }
    }

    /// A long fault's end: its window runs from here too (a broker back, its replicas
    /// catching up, leaders moving back).
    fn mark_end(&mut self, kind: &str) {
        self.timeline.push((chrono::Utc::now(), format!("{kind} (over)")));
    }

    /// Waits `time`, tending the fleet meanwhile (a fault that lasts).
    async fn wait(&mut self, rng: &mut StdRng, time: Duration) {
        let until = Instant::now() + time;
        while Instant::now() < until {
            self.tend(rng, true).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn count(&mut self, kind: impl Into<String>) {
        let kind = kind.into();
        let at = self.landing.take().unwrap_or_else(chrono::Utc::now);
        self.timeline.push((at, kind.clone()));
        *self.faults.entry(kind).or_default() += 1;
    }

    /// Scrapes counters, resumes paused processes, restarts what died on its own.
    async fn tend(&mut self, rng: &mut StdRng, arm: bool) {
        for i in 0..self.slots.len() {
            if let Some(until) = self.slots[i].paused_until
                && Instant::now() >= until
                && let Some(s) = &self.slots[i].service
            {
                s.signal("CONT");
                self.slots[i].paused_until = None;
                self.publish_ports();
            }
            let paused = self.slots[i].paused_until.is_some();
            let Some(service) = self.slots[i].service.as_mut() else { continue };
            if !paused && let Some(text) = service.scrape().await {
                for name in COUNTERS {
                    if let Some(v) = metric_sum(&text, name) {
                        self.slots[i].last.insert(name, v);
                    }
                }
            }
            let service = self.slots[i].service.as_mut().expect("present");
            if let Some(status) = service.wait_exit(Duration::ZERO) {
                let pid = service.pid();
                let log = service.log_text();
                let binary = self.slots[i].binary;
                let kind = match &self.slots[i].armed {
                    Some(armed) => {
                        format!("failpoint {}", armed.split('@').next().unwrap_or(armed))
                    }
                    // A bad job's handler aborting its process: a fault of its own making.
                    None if std::os::unix::process::ExitStatusExt::signal(&status) == Some(6) => {
                        format!("{binary} aborted by a bad job's handler")
                    }
                    None => {
                        // Not a fault the campaign made: say why, from the process's own log —
                        // its error and causes (before a backtrace), else its last lines.
                        eprintln!(
                            "campaign: {binary} (pid {pid}) exited by itself ({status}); its log \
                             says:\n  {}",
                            exit_reason(&log).join("\n  ")
                        );
                        format!("{binary} exited by itself ({status})")
                    }
                };
                self.count(kind);
                self.bank(i);
                if binary == "jobfold-test-processor" {
                    self.deaths.insert(pid);
                }
                self.slots[i].service = None;
                let armed = if arm { self.arm(rng, binary) } else { None };
                self.replace(i, armed);
            }
        }
    }

    fn arm(&self, rng: &mut StdRng, binary: &str) -> Option<String> {
        if !rng.random_bool(0.5) {
            return None;
        }
        let name = if binary == "jobfold-relay" {
            failpoint::RELAY_AFTER_PRODUCE_BEFORE_MARK
        } else {
            PROCESSOR_FAILPOINTS[rng.random_range(0..PROCESSOR_FAILPOINTS.len())]
        };
        Some(format!("{name}@{}", rng.random_range(1..=6)))
    }

    /// Starts a new process in slot `i`'s place.
    fn replace(&mut self, i: usize, armed: Option<String>) {
        let binary = self.slots[i].binary;
        let name = self.slots[i].name.clone();
        let new = self.start_as(binary, armed, name);
        self.slots.swap(i, new);
        self.slots.pop();
        self.publish_ports();
    }

    fn counter(&self, name: &str) -> u64 {
        let live: f64 = self.slots.iter().filter_map(|s| s.last.get(name)).sum();
        (live + self.banked.get(name).copied().unwrap_or(0.0)) as u64
    }
}

fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        if series.split('{').next() == Some(name) {
            *found.get_or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    found
}

/// The input of job `n`: a share of invalid, transient-failure and slow jobs.
fn input(rng: &mut StdRng, n: u64) -> serde_json::Value {
    let roll: f64 = rng.random();
    if roll < 0.06 {
        json!({"title": "no text", "n": n})
    } else if roll < 0.20 {
        json!({"text": format!("flaky {n}"), "simulate": {"fail_attempts": rng.random_range(1..=2)}})
    } else if roll < 0.30 {
        json!({"text": format!("slow {n}"), "simulate": {"sleep_ms": rng.random_range(1_500..4_000)}})
    } else {
        json!({"text": format!("document {n}"), "simulate": {"sleep_ms": rng.random_range(0..60)}})
    }
}

/// Job `n`'s document and version: 40 documents, versions rising.
fn target(n: u64) -> (String, i64) {
    (format!("doc-{:02}", n % 40), (n / 40 + 1) as i64)
}

/// Runs the campaign; the outcome says whether the history held.
///
/// # Errors
/// The services or the processes could not be started at all.
pub async fn run(plan: &Plan) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let services = Services::new(plan);
    // The three start side by side: Kafka's and the registry's JVMs take the longest.
    tokio::try_join!(
        services.run("postgres", &["start"]),
        services.run("kafka", &["start"]),
        services.run("registry", &["start"]),
    )?;
    let mut config = Config::load(None).expect("the defaults load");
    config.database_url =
        Sensitive::new(services.run("postgres", &["url"]).await?.trim().to_owned());
    config.database.require_sync_standby = plan.pg_nodes == 2;
    config.kafka_brokers = services.run("kafka", &["brokers"]).await?.trim().to_owned();
    if plan.brokers == 3 {
        config.topics.replication_factor = 3;
        config.topics.min_insync_replicas = 2;
    }
    config.schema_registry_url = jobfold_common::config::SecretUrl::new(format!(
        "http://127.0.0.1:{}/apis/ccompat/v7",
        services.port(5)
    ));
    let pool = jobfold_common::db::connect(&config, 8).await?;
    crate::handlers::migrate(&pool).await?;
    // Producers may start before the first processor registers its kinds.
    let remote = crate::bad::RemoteBad::start().await?;
    let handlers = crate::handlers::handlers().with(
        crate::bad::REMOTE,
        jobfold_processor::remote::Remote::new(&remote.url, config.processor.max_output_bytes)?,
    );
    jobfold_processor::handler::register(&handlers, &pool, "campaign").await?;
    // The events topic takes 64 KiB, so that a result over the limit is also one Kafka would
    // refuse: were it not quarantined, it would hold its document's events back.
    let mut topics: Vec<_> = jobfold_common::kafka::jobfold_topics(&config).into_iter().collect();
    topics[0].config.push(("max.message.bytes", EVENTS_TOPIC_LIMIT.to_string()));
    jobfold_common::kafka::ensure_topics(&config, &topics).await?;
    if plan.brokers == 3 {
        // What a broker's loss must not cost, as the binaries check it at start.
        let t = &config.topics;
        let described =
            jobfold_common::kafka::describe_topics(&config, &[&t.events, &t.requests]).await?;
        for (topic, settings) in &described {
            anyhow::ensure!(
                settings.replicas == 3
                    && settings.config.get("min.insync.replicas").map(String::as_str) == Some("2")
                    && settings.config.get("unclean.leader.election.enable").map(String::as_str)
                        == Some("false"),
                "topic {topic} is not as the cluster campaign needs it: {settings:?}"
            );
            jobfold_common::kafka::check_durability(&config, topic, settings)?;
        }
    }

    let env: std::collections::HashMap<String, String> = [
        ("JOBFOLD_DATABASE_URL", config.database_url.expose().clone()),
        (
            "JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY",
            config.database.require_sync_standby.to_string(),
        ),
        ("JOBFOLD_KAFKA_BROKERS", config.kafka_brokers.clone()),
        ("JOBFOLD_SCHEMA_REGISTRY_URL", config.schema_registry_url.expose().to_owned()),
        ("JOBFOLD_TOPICS__REPLICATION_FACTOR", config.topics.replication_factor.to_string()),
        ("JOBFOLD_TOPICS__MIN_INSYNC_REPLICAS", config.topics.min_insync_replicas.to_string()),
        ("JOBFOLD_PROCESSOR__LEASE_TTL", "3s".into()),
        ("JOBFOLD_PROCESSOR__HEARTBEAT", "1s".into()),
        ("JOBFOLD_PROCESSOR__RETRY_BASE", "100ms".into()),
        ("JOBFOLD_PROCESSOR__RETRY_CAP", "500ms".into()),
        ("JOBFOLD_PROCESSOR__REAPER_INTERVAL", "500ms".into()),
        ("JOBFOLD_PROCESSOR__REAPER_GRACE", "1s".into()),
        ("JOBFOLD_PROCESSOR__REVOKE_TIMEOUT", "3s".into()),
        ("JOBFOLD_PROCESSOR__SHUTDOWN_TIMEOUT", "3s".into()),
        ("JOBFOLD_PROCESSOR__STALL_AFTER", "2min".into()),
        // A suspect's run waits past the session time-out and a few commit intervals: its
        // partition's new owner gets through the backlog before the suspect runs again.
        ("JOBFOLD_PROCESSOR__CRASH_BACKOFF", "10s".into()),
        ("JOBFOLD_PROCESSOR__GAUGE_INTERVAL", "1s".into()),
        // Bad jobs: a result over 16 KiB is refused (the events topic takes 64 KiB), a run
        // past 6 s is cancelled.
        ("JOBFOLD_PROCESSOR__MAX_OUTPUT_BYTES", "16384".into()),
        ("JOBFOLD_ACCEPT__MAX_INPUT_BYTES", "16384".into()),
        // Fewer slots than the busy document has versions.
        ("JOBFOLD_PROCESSOR__MAX_IN_FLIGHT", "64".into()),
        ("JOBFOLD_KINDS__INDEX-DOCUMENT__RUN_TIMEOUT", "6s".into()),
        // A limit no load reaches, so that `cost` is asked (and may panic).
        ("JOBFOLD_KINDS__INDEX-DOCUMENT__COST_PER_MINUTE", "1000000000".into()),
        // The bad jobs' HTTP handler, in this process; a call past 2 s is dropped.
        ("JOBFOLD_KINDS__REMOTE-BAD__URL", format!("{}/", remote.url)),
        ("JOBFOLD_KINDS__REMOTE-BAD__REQUEST_TIMEOUT", "2s".into()),
        // Any wait a handler asks for is cut to 3 s (10 min by default), so that one asking
        // for 3,000 years still ends within the run.
        ("JOBFOLD_PROCESSOR__MAX_RETRY_AFTER", "3s".into()),
        ("JOBFOLD_RELAY__STANDBY_RETRY", "200ms".into()),
        ("JOBFOLD_RELAY__POLL_INTERVAL", "200ms".into()),
        ("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS", "6000".into()),
        // Partitions a named processor left to no one as it died (aborted by a bad job
        // while handing them on) are given out again within 13 s, inside the fault's window.
        ("JOBFOLD_PROCESSOR__ASSIGNMENT_CHECK", "2s".into()),
        // CAMPAIGN_RUST_LOG sets the processes' log filter for a closer look at a run.
        ("RUST_LOG", std::env::var("CAMPAIGN_RUST_LOG").unwrap_or_else(|_| "info".into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let ports = Arc::new(Mutex::new(Vec::new()));
    let mut fleet = Fleet {
        env,
        slots: Vec::new(),
        banked: BTreeMap::new(),
        faults: BTreeMap::new(),
        timeline: Vec::new(),
        landing: None,
        under_min_isr: Vec::new(),
        ports: Arc::clone(&ports),
        deaths: std::collections::HashSet::new(),
        named: 0,
    };
    for binary in
        ["jobfold-relay", "jobfold-relay", "jobfold-test-processor", "jobfold-test-processor"]
    {
        fleet.start(binary, None);
    }

    // Producers.
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicU64::new(0));
    let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
    let producers = vec![
        tokio::spawn(http_producer(
            plan.clone(),
            Arc::clone(&ports),
            Arc::clone(&next),
            Arc::clone(&acknowledged),
            Arc::clone(&stop),
        )),
        tokio::spawn(api_producer(
            plan.clone(),
            config.clone(),
            pool.clone(),
            Arc::clone(&next),
            Arc::clone(&acknowledged),
            Arc::clone(&stop),
        )),
        tokio::spawn(intake_producer(
            plan.clone(),
            config.clone(),
            Arc::clone(&next),
            Arc::clone(&acknowledged),
            Arc::clone(&stop),
        )),
    ];
    let ledger = Arc::new(Mutex::new(crate::bad::Ledger::default()));
    let hot = Arc::new(AtomicBool::new(false));
    let bad = crate::bad::Producer {
        seed: plan.seed,
        rate: plan.bad_share * 3.0 * plan.rate / (1.0 - plan.bad_share).max(0.01),
        hot_versions: plan.hot_versions,
        pool: pool.clone(),
        acceptor: jobfold_common::accept::Acceptor::new(
            Codec::connect(config.registry()?, &config.topics.events).await?,
            config.accept_policy(),
            "campaign-bad",
        ),
        requests: Codec::<JobRequest>::connect(config.registry()?, &config.topics.requests).await?,
        kafka: config
            .kafka_client_for(
                jobfold_common::config::KafkaRole::Producer,
                jobfold_relay::publish::PRODUCER_DEFAULTS,
            )
            .set("message.timeout.ms", "10000")
            .create()?,
        requests_topic: config.topics.requests.clone(),
        ports: Arc::clone(&ports),
        ledger: Arc::clone(&ledger),
        hot: Arc::clone(&hot),
        stop: Arc::clone(&stop),
    };
    let producers = {
        let mut producers = producers;
        producers.push(tokio::spawn(bad.run()));
        producers
    };
    let watching = Arc::new(AtomicBool::new(true));
    let watch = tokio::spawn(CursorWatch::default().run(pool.clone(), Arc::clone(&watching)));

    // Faults, with three quiet stretches (history::QUIET_STRETCHES) so that the delay bound
    // is tested outside the faults' windows more than once: one at a quarter and one at
    // three quarters of the faults, each a fault window and QUIET_EXTRA longer, and one past
    // the first third, where the busy document comes once the last fault's window has closed,
    // so what it costs the others is measured on its own.
    let mut injected = 0;
    let cluster = plan.brokers == 3;
    let mut next_fault = Instant::now() + Duration::from_secs(3);
    let quiet_after =
        rng.random_range(plan.faults / 3..=(2 * plan.faults / 3).max(plan.faults / 3));
    let mut plain_quiet = vec![plan.faults / 4, 3 * plan.faults / 4];
    plain_quiet.retain(|at| *at != quiet_after && *at > 0);
    while injected < plan.faults {
        fleet.tend(&mut rng, true).await;
        if Instant::now() < next_fault {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if let Some(at) = plain_quiet.iter().position(|at| *at == injected) {
            plain_quiet.remove(at);
            let quiet_until = Instant::now() + plan.fault_window + history::QUIET_EXTRA;
            while Instant::now() < quiet_until {
                fleet.tend(&mut rng, false).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        if injected == quiet_after && !hot.load(Ordering::SeqCst) {
            let quiet_until = Instant::now() + plan.fault_window + plan.quiet;
            while Instant::now() < quiet_until {
                fleet.tend(&mut rng, false).await;
                if Instant::now() + plan.quiet >= quiet_until {
                    hot.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let failover_due = match plan.failover_every {
            Some(every) => injected % every.max(1) == every.max(1) - 1,
            None => injected == plan.faults / 3,
        };
        // (The refusal and the pause keep their place half-way.)
        if services.pg_pair && failover_due && injected != plan.faults / 2 {
            // A failover, once a run at least: its own random numbers, as the pause's.
            let mut failing = StdRng::seed_from_u64(plan.seed ^ u64::from_be_bytes(*b"failover"));
            fleet.landing = Some(chrono::Utc::now());
            failover(&mut fleet, &services, &mut failing).await?;
            fleet.landing = None;
        } else if injected == plan.faults / 2 {
            // Dealt once a run at least (and at random besides, on one broker).
            fleet.landing = Some(chrono::Utc::now());
            refuse_an_event(&config, &pool, &ledger, &mut rng).await?;
            fleet.count(REFUSED_FAULT);
            // An operator's pause, once a run, after it: its own random numbers, so the
            // seed's plan of the other faults stays what it was without it.
            let mut pausing =
                StdRng::seed_from_u64(plan.seed ^ u64::from_be_bytes(*b"\0\0\0pause"));
            fleet.landing = Some(chrono::Utc::now());
            pause_then_resume(&mut fleet, &config, &pool, &mut pausing).await?;
            fleet.count(PAUSE_RESUME);
            fleet.mark_end(PAUSE_RESUME);
        } else {
            inject(
                &mut fleet,
                &services,
                &config,
                &pool,
                &ledger,
                cluster.then_some(injected % 2 == 1),
                &mut rng,
            )
            .await?;
        }
        injected += 1;
        next_fault =
            Instant::now() + Duration::from_millis(rng.random_range(plan.gap_ms.0..=plan.gap_ms.1));
    }

    // Drain: producers stop, every process runs unarmed, the work settles. Paused processes
    // resume first: a producer finishes only once its request in flight is answered, and
    // with every processor paused nothing would answer it.
    stop.store(true, Ordering::SeqCst);
    // Every broker runs (a fault that failed half-way may have left one down), and every
    // Postgres node.
    services.run("kafka", &["start"]).await?;
    services.run("postgres", &["start"]).await?;
    for i in 0..fleet.slots.len() {
        if fleet.slots[i].paused_until.take().is_some()
            && let Some(s) = &fleet.slots[i].service
        {
            s.signal("CONT");
        }
    }
    fleet.publish_ports();
    // Processors a bad job aborts meanwhile are started again while the producers finish:
    // with every processor dead (aborts, three deaths each by default), nothing would
    // answer their last requests, and a cluster run once waited here until its time-out.
    let mut finishing = futures::future::join_all(producers);
    let finished = loop {
        tokio::select! {
            finished = &mut finishing => break finished,
            () = tokio::time::sleep(Duration::from_millis(500)) => fleet.tend(&mut rng, false).await,
        }
    };
    for producer in finished {
        producer.context("a producer panicked")??;
    }
    let deadline = Instant::now() + plan.drain_timeout;
    for i in 0..fleet.slots.len() {
        if fleet.slots[i].armed.is_some() {
            fleet.bank(i);
            fleet.kill9(i);
            fleet.replace(i, None);
        }
    }
    while fleet.live("jobfold-test-processor").len() < 2 {
        fleet.start("jobfold-test-processor", None);
    }
    let acknowledged = acknowledged.lock().expect("acknowledged").clone();
    loop {
        fleet.tend(&mut rng, false).await;
        if settled(&pool, &acknowledged).await.unwrap_or(false) || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The last counters, then a graceful stop.
    fleet.tend(&mut rng, false).await;
    for slot in &fleet.slots {
        if let Some(s) = &slot.service {
            s.signal("TERM");
        }
    }
    for slot in &mut fleet.slots {
        if let Some(s) = slot.service.as_mut()
            && s.wait_exit(Duration::from_secs(20)).is_none()
        {
            s.kill9();
        }
    }

    watching.store(false, Ordering::SeqCst);
    let relay_stalls = watch.await?;
    let mut ledger = ledger.lock().expect("ledger").clone();
    ledger.redirects_followed = remote.followed.load(Ordering::SeqCst);
    // A delivered event is produced again only by a relay crash between producing and
    // marking (or its connection to Postgres or Kafka lost there): each can add one copy.
    let relay_crashes: u64 = fleet
        .faults
        .iter()
        .filter(|(kind, _)| {
            kind.contains("relay") || kind.contains("Kafka") || kind.contains("Postgres")
        })
        .map(|(_, n)| n)
        .sum();
    let observed = history::Observed {
        deaths: fleet.deaths.clone(),
        relay_stalls,
        faults: fleet.timeline.clone(),
        fault_window: plan.fault_window,
        copies_bound: 1 + relay_crashes,
        delay_bound: plan.delay_bound,
    };
    let mut history = history::check(&config, &pool, &acknowledged, &ledger, &observed).await?;
    // Every parked event went out in the end: the limit was raised after each lowering
    // (and the refused events retried), so none may be left, and none behind them.
    let parked = jobfold_relay::parked::list(&pool, 20).await?;
    if !parked.is_empty() {
        let rows: Vec<String> = parked
            .iter()
            .map(|p| {
                format!(
                    "seq {} ({} of {}, {} bytes, {}, parked {}, retry asked {:?}, {} attempt(s): {})",
                    p.seq,
                    p.event,
                    p.key,
                    p.bytes,
                    if p.refused { "refused" } else { "waiting" },
                    p.parked_at,
                    p.retry_requested_at,
                    p.attempts,
                    p.reason
                )
            })
            .collect();
        history.findings.push(format!("events were left parked at the end: {}", rows.join("; ")));
    }
    if plan.bad_share > 0.0 {
        // A kind never submitted proves nothing about it.
        for kind in crate::bad::BadKind::DRAWN.iter().chain([&crate::bad::BadKind::HotDocument]) {
            if !history.bad.contains_key(kind.name()) {
                history.findings.push(format!("no bad job \"{}\" was submitted", kind.name()));
            }
        }
    }
    // Under min.insync.replicas the relay waits on Kafka; its gauge must still follow the
    // backlog (it lags by its 2 s refresh, so half of the most that waited is the bar).
    for (gauge, waiting) in &fleet.under_min_isr {
        if *waiting >= 20 && *gauge < *waiting as f64 / 2.0 {
            history.findings.push(format!(
                "under min.insync.replicas {waiting} events waited but the relay's backlog \
                 gauge showed at most {gauge:.0}: the alert would not fire"
            ));
        }
    }
    pool.close().await;
    drop(services);
    Ok(Outcome {
        seed: plan.seed,
        under_min_isr: fleet.under_min_isr.clone(),
        faults: fleet.faults.clone(),
        duplicates_skipped: fleet.counter("jobfold_duplicates_skipped_total"),
        fenced_completions: fleet.counter("jobfold_fenced_completions_total"),
        handler_runs: fleet.counter("jobfold_handler_runs_total"),
        intake_duplicates: fleet.counter("jobfold_intake_duplicates_total"),
        elapsed: started.elapsed(),
        history,
        ledger,
    })
}

/// When the relay's cursor stood still while events waited to be published.
#[derive(Debug, Default)]
struct CursorWatch {
    /// The cursor, when it was first seen there, and when last seen there with events waiting.
    last: Option<((i64, i64), Utc, Option<Utc>)>,
    stalls: Vec<(Utc, Utc)>,
}

type Utc = chrono::DateTime<chrono::Utc>;

impl CursorWatch {
    /// Looks twice a second until `watching` is cleared, on its own task so that a fault
    /// being injected does not hide a stall; a look that fails (Postgres restarting) is
    /// skipped, the time still counting.
    async fn run(mut self, pool: PgPool, watching: Arc<AtomicBool>) -> Vec<(Utc, Utc)> {
        while watching.load(Ordering::SeqCst) {
            self.look(&pool).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.end_stall();
        self.stalls
    }

    fn end_stall(&mut self) {
        if let Some((_, since, Some(seen))) = self.last.take() {
            self.stalls.push((since, seen));
        }
    }

    async fn look(&mut self, pool: &PgPool) {
        let cursor: Result<(i64, i64), _> =
            sqlx::query_as("SELECT published_xid::text::bigint, published_seq FROM relay_cursor")
                .fetch_one(pool)
                .await;
        let (Ok(cursor), Ok(waiting)) = (cursor, waiting_for_the_relay(pool).await) else {
            return;
        };
        let now = chrono::Utc::now();
        match &mut self.last {
            Some((at, _, seen)) if *at == cursor && waiting > 0 => *seen = Some(now),
            // Moved, or nothing waits: any stall ended.
            _ => {
                self.end_stall();
                self.last = Some((cursor, now, None));
            }
        }
    }
}

/// Events the relay is due to publish: after its log cursor (the delayed ones aside), and
/// due outbox rows. Parked events are not (they wait for a higher limit or an operator:
/// those left at the end are a finding of their own), nor delayed rows not yet due.
async fn waiting_for_the_relay(pool: &PgPool) -> Result<i64, sqlx::Error> {
    // language=PostgreSQL
    sqlx::query_scalar(
        r#"
        SELECT (SELECT count(*) FROM relay_cursor c, LATERAL (
                    SELECT 1 FROM job_events e
                    WHERE (e.xid, e.seq) > (c.published_xid, c.published_seq) AND NOT e.delayed
                ) after)
             + (SELECT count(*) FROM outbox WHERE published_at IS NULL AND available_at <= now())
        "#,
    )
    .fetch_one(pool)
    .await
}

/// How a [`refuse_an_event`] fault is counted.
const REFUSED_FAULT: &str = "events topic's limit lowered under the relays, then raised";

/// The events topic's limit in the campaign, and the one a [`refuse_an_event`] fault
/// lowers it to for a while.
const EVENTS_TOPIC_LIMIT: usize = 64 * 1024;
const LOWERED_LIMIT: usize = 4 * 1024;

/// Sets the events topic's `max.message.bytes`, keeping the topic's other settings (an
/// AlterConfigs request replaces them all).
async fn set_events_limit(config: &Config, bytes: usize) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        config.kafka_client().create()?;
    let spec = jobfold_common::kafka::jobfold_topics(config).remove(0);
    let limit = bytes.to_string();
    let mut change = AlterConfig::new(ResourceSpecifier::Topic(&config.topics.events))
        .set("max.message.bytes", &limit);
    for (key, value) in &spec.config {
        change = change.set(key, value);
    }
    // The broker may be restarting after an earlier fault: try for a minute.
    let mut last = None;
    for _ in 0..120 {
        match admin.alter_configs(std::slice::from_ref(&change), &AdminOptions::new()).await {
            Ok(results) if results.iter().all(Result::is_ok) => return Ok(()),
            Ok(results) => last = Some(format!("{results:?}")),
            Err(e) => last = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("altering the events topic's max.message.bytes: {last:?}")
}

/// A fault: the events topic's `max.message.bytes` lowered under the running relays (which
/// read it at start), a job submitted whose event is over the new limit (random letters,
/// which lz4 cannot shrink under it), then, once the relay parked it (or after 30 s), the
/// limit raised back and every parked event retried, as an operator would (`jobfold parked
/// retry --all`). The job must then succeed, and no other document may wait on it meanwhile.
/// Pauses the test kind (its dispatches are passed over in every processor, its running
/// jobs finish), waits 1–6 s tending the fleet, and resumes it (what waited is dispatched
/// again). Each step is tried for a while: Postgres may be back from an earlier fault.
async fn pause_then_resume(
    fleet: &mut Fleet,
    config: &Config,
    pool: &PgPool,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    use jobfold_processor::store::kinds::{self, KindControl};
    let control = || KindControl {
        requested_by: Some("campaign".into()),
        reason: Some("a fault: an operator's pause".into()),
    };
    let kind = crate::handlers::KIND;
    let mut paused = None;
    for _ in 0..100 {
        match kinds::pause(pool, kind, control()).await {
            Ok(done) => {
                paused = Some(done);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    anyhow::ensure!(paused.is_some(), "pausing {kind} failed for 20 s");
    let paused_for = Duration::from_millis(rng.random_range(1_000..6_000));
    fleet.wait(rng, paused_for).await;
    let codec = Codec::connect(config.registry()?, &config.topics.events).await?;
    let events = jobfold_processor::store::Events {
        codec,
        topic: config.topics.events.clone(),
        producer: "campaign".into(),
    };
    let mut last = None;
    for _ in 0..100 {
        match kinds::resume(pool, &events, kind, control()).await {
            Ok(_) => return Ok(()),
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Err(anyhow::anyhow!("resuming {kind} failed for 20 s: {last:?}"))
}

async fn refuse_an_event(
    config: &Config,
    pool: &PgPool,
    ledger: &Mutex<crate::bad::Ledger>,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    use jobfold_relay::parked::{self as park, Selection};
    set_events_limit(config, LOWERED_LIMIT).await?;
    let document = format!("bad-refused-{}", rng.random::<u32>());
    let text: String =
        (0..12_000).map(|_| char::from(rng.sample(rand::distr::Alphanumeric))).collect();
    let job = NewJob {
        document_id: document.clone(),
        kind: "index-document".into(),
        input_version: 1,
        input: json!({ "text": text }),
        idempotency_key: None,
        trace: None,
        run_at: None,
    };
    let codec = Codec::connect(config.registry()?, &config.topics.events).await?;
    let acceptor = jobfold_common::accept::Acceptor::new(codec, config.accept_policy(), "campaign");
    let submitted_at = chrono::Utc::now();
    // Postgres may be restarting after an earlier fault: try for a while.
    let mut accepted = None;
    for _ in 0..100 {
        match acceptor.accept(pool, &job).await {
            Ok(done) => {
                accepted = Some(done.job_id);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let mut parked = false;
    if let Some(job_id) = accepted {
        ledger.lock().expect("ledger").bad.push(crate::bad::Bad {
            kind: crate::bad::BadKind::RefusedByBroker,
            document,
            job_id: Some(job_id),
            expect: crate::bad::Expect::Succeeded,
            submitted_at,
        });
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            // language=PostgreSQL
            let found: Option<bool> = sqlx::query_scalar(
                "SELECT true FROM relay_parked p JOIN job_events e USING (seq) \
                 WHERE e.job_id = $1 AND p.refused",
            )
            .bind(job_id)
            .fetch_optional(pool)
            .await
            .unwrap_or(None);
            if found.is_some() {
                parked = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    set_events_limit(config, EVENTS_TOPIC_LIMIT).await?;
    if !parked {
        tracing::warn!("The event over the lowered limit was not parked within 30 s.");
    }
    for _ in 0..100 {
        if park::request_retry(pool, &Selection::All).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Every acknowledged intake request has its job, and nothing is unfinished or unpublished.
async fn settled(pool: &PgPool, acknowledged: &Acknowledged) -> anyhow::Result<bool> {
    let keys: Vec<String> = acknowledged.requests.iter().map(|r| format!("request:{r}")).collect();
    // language=PostgreSQL
    let (missing, unfinished, unpublished): (i64, i64, i64) = sqlx::query_as(
        r#"
        SELECT (SELECT count(*) FROM unnest($1::text[]) k WHERE NOT EXISTS
                    (SELECT 1 FROM jobs WHERE idempotency_key = k)),
               (SELECT count(*) FROM jobs WHERE state IN ('queued', 'leased', 'retry_wait')),
               0::bigint
        "#,
    )
    .bind(&keys)
    .fetch_one(pool)
    .await?;
    let unpublished = unpublished + jobfold_common::gauges::unpublished(pool).await?;
    Ok(missing == 0 && unfinished == 0 && unpublished == 0)
}

async fn inject(
    fleet: &mut Fleet,
    services: &Services,
    config: &Config,
    pool: &PgPool,
    ledger: &Mutex<crate::bad::Ledger>,
    on_cluster: Option<bool>,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    fleet.landing = Some(chrono::Utc::now());
    // On a cluster every second fault strikes Kafka ([`broker_fault`]).
    if on_cluster == Some(true) {
        broker_fault(fleet, services, config, pool, rng).await?;
        fleet.landing = None;
        return Ok(());
    }
    let roll = rng.random_range(0..100);
    // (The one broker's restart has no place on a cluster: a processor is killed instead.)
    let roll = if on_cluster.is_some() && (60..=69).contains(&roll) { roll - 60 } else { roll };
    let processors = fleet.live("jobfold-test-processor");
    let relays = fleet.live("jobfold-relay");
    match roll {
        0..=29 if !processors.is_empty() => {
            let i = processors[rng.random_range(0..processors.len())];
            fleet.bank(i);
            fleet.kill9(i);
            let armed = fleet.arm(rng, "jobfold-test-processor");
            fleet.replace(i, armed);
            fleet.count("kill -9 processor");
        }
        30..=44 if !relays.is_empty() => {
            let i = relays[rng.random_range(0..relays.len())];
            fleet.bank(i);
            if let Some(mut s) = fleet.slots[i].service.take() {
                s.kill9();
            }
            let armed = fleet.arm(rng, "jobfold-relay");
            fleet.replace(i, armed);
            fleet.count("kill -9 relay");
        }
        45..=59 if processors.len() >= 2 => {
            let i = processors[rng.random_range(0..processors.len())];
            if let Some(s) = &fleet.slots[i].service {
                s.signal("STOP");
                // Past the 3 s lease and the 6 s session: the group moves its partitions,
                // another member leases its jobs again, and its completions are fenced.
                fleet.slots[i].paused_until =
                    Some(Instant::now() + Duration::from_millis(rng.random_range(8_000..12_000)));
                fleet.publish_ports();
                fleet.count("SIGSTOP processor past its lease, then SIGCONT");
            }
        }
        60..=69 => {
            services.script("kafka", "kill")?;
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..3_000))).await;
            services.script("kafka", "start")?;
            fleet.count("kill -9 Kafka broker, restart");
        }
        70..=79 if services.pg_pair => postgres_fault(fleet, services, roll - 70, rng).await?,
        70..=79 => {
            services.script("postgres", "restart-immediate")?;
            fleet.count("Postgres immediate restart");
        }
        80..=84 => {
            refuse_an_event(config, pool, ledger, rng).await?;
            fleet.count(REFUSED_FAULT);
        }
        93..=99 if !processors.is_empty() => {
            // A deploy: each processor in turn stops gracefully (SIGTERM: its running jobs
            // finish or are given back) and a new one takes its place.
            for i in processors {
                fleet.terminate(i);
                fleet.replace(i, None);
            }
            fleet.count(ROLLING_RESTART);
            fleet.mark_end(ROLLING_RESTART);
        }
        _ => {
            if processors.len() < 3 {
                fleet.start("jobfold-test-processor", None);
                fleet.count("add processor (rebalance)");
            } else {
                let i = processors[rng.random_range(0..processors.len())];
                fleet.terminate(i);
                fleet.slots.remove(i);
                fleet.publish_ports();
                fleet.count("remove processor (rebalance)");
            }
        }
    }
    fleet.landing = None;
    Ok(())
}

/// The primary killed and its standby promoted, as its machine's death and an operator's (or
/// a failover manager's) promotion; the old primary comes back as the new one's standby
/// after `rejoin_after` (every commit waits for a standby until then).
pub const FAILOVER: &str = "Postgres: kill -9 the primary, promote the standby, rejoin";

/// One fault on a Postgres pair, by `roll` (0–9): a failover (0–3), a planned switchover
/// (4–6), or the standby killed for 1–4 s (7–9). Each leaves the pair whole again.
async fn postgres_fault(
    fleet: &mut Fleet,
    services: &Services,
    roll: u32,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    match roll {
        0..=3 => failover(fleet, services, rng).await?,
        4..=6 => {
            services.run("postgres", &["switchover"]).await?;
            fleet.count("Postgres: planned switchover");
        }
        _ => {
            let primary: u8 = services.run("postgres", &["primary"]).await?.trim().parse()?;
            let standby = (3 - primary).to_string();
            services.run("postgres", &["kill", &standby]).await?;
            tokio::time::sleep(Duration::from_millis(rng.random_range(1_000..4_000))).await;
            services.run("postgres", &["start-node", &standby]).await?;
            fleet.count("Postgres: kill -9 the synchronous standby, restart (commits wait)");
        }
    }
    Ok(())
}

async fn failover(fleet: &mut Fleet, services: &Services, rng: &mut StdRng) -> anyhow::Result<()> {
    let primary = services.run("postgres", &["primary"]).await?.trim().to_owned();
    services.run("postgres", &["failover"]).await?;
    tokio::time::sleep(Duration::from_millis(rng.random_range(500..3_000))).await;
    services.run("postgres", &["rejoin", &primary]).await?;
    fleet.count(FAILOVER);
    Ok(())
}

/// One fault on the three-broker cluster. Each one that takes a broker down brings it back
/// before it returns, so no two overlap; the fault's window also runs from its end.
async fn broker_fault(
    fleet: &mut Fleet,
    services: &Services,
    config: &Config,
    pool: &PgPool,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let kind = match rng.random_range(0..100) {
        0..=23 => {
            let node = crate::cluster::busiest_partition_leader(config, &config.topics.events)
                .await?
                .to_string();
            kill_and_restart(fleet, services, rng, &[&node]).await?;
            "Kafka: kill -9 the leader of the busiest events partition, restart"
        }
        24..=43 => {
            let node = crate::cluster::coordinator(config, &config.processor.group).await?;
            kill_and_restart(fleet, services, rng, &[&node.to_string()]).await?;
            "Kafka: kill -9 the processors' group coordinator, restart"
        }
        44..=59 => {
            let node = services.run("kafka", &["controller"]).await?.trim().to_owned();
            kill_and_restart(fleet, services, rng, &[&node]).await?;
            "Kafka: kill -9 the active controller, restart"
        }
        60..=75 => {
            // Past broker.session.timeout.ms (9 s): the controller fences the broker and
            // moves its leaderships; when it resumes it finds itself behind.
            let node = rng.random_range(1..=3).to_string();
            services.run("kafka", &["pause", &node]).await?;
            let paused = Duration::from_millis(rng.random_range(11_000..15_000));
            fleet.wait(rng, paused).await;
            services.run("kafka", &["resume", &node]).await?;
            "Kafka: SIGSTOP a broker past its session, SIGCONT"
        }
        76..=87 => {
            // As an operator upgrades: one at a time, each back and caught up before the next.
            for node in ["1", "2", "3"] {
                services.run("kafka", &["stop", node]).await?;
                services.run("kafka", &["start", node]).await?;
                caught_up(fleet, config, rng).await;
                fleet.mark_end("Kafka: rolling restart, one broker");
            }
            "Kafka: rolling restart of all three brokers"
        }
        _ => {
            // Under min.insync.replicas: no event can be published and the group may lose its
            // coordinator; the relay waits, nothing is lost.
            let mut nodes = vec!["1", "2", "3"];
            nodes.remove(rng.random_range(0..3));
            for node in &nodes {
                services.run("kafka", &["kill", node]).await?;
            }
            // The relay's backlog gauge must show what waits meanwhile (the alert reads it):
            // sampled twice a second until both brokers are back.
            let down = Duration::from_millis(rng.random_range(3_000..8_000));
            let restart = async {
                tokio::time::sleep(down).await;
                services.run("kafka", &["start"]).await
            };
            tokio::pin!(restart);
            let (mut gauge, mut waiting) = (0.0f64, 0i64);
            let restarted = loop {
                tokio::select! {
                    restarted = &mut restart => break restarted,
                    () = tokio::time::sleep(Duration::from_millis(500)) => {
                        for i in fleet.live("jobfold-relay") {
                            if let Some(s) = &fleet.slots[i].service
                                && let Some(text) = s.scrape().await
                                && let Some(v) = metric_sum(&text, "jobfold_relay_backlog")
                            {
                                gauge = gauge.max(v);
                            }
                        }
                        if let Ok(n) = jobfold_common::gauges::unpublished(pool).await {
                            waiting = waiting.max(n);
                        }
                    }
                }
            };
            restarted?;
            fleet.under_min_isr.push((gauge, waiting));
            "Kafka: kill -9 two brokers at once (under min.insync.replicas), restart"
        }
    };
    fleet.count(kind);
    fleet.mark_end(kind);
    Ok(())
}

/// SIGKILL of `nodes`, 1–8 s down, then started again (all at once: two of three controllers
/// are a quorum only together).
async fn kill_and_restart(
    fleet: &mut Fleet,
    services: &Services,
    rng: &mut StdRng,
    nodes: &[&str],
) -> anyhow::Result<()> {
    for node in nodes {
        services.run("kafka", &["kill", node]).await?;
    }
    let down = Duration::from_millis(rng.random_range(1_000..8_000));
    fleet.wait(rng, down).await;
    services.run("kafka", &["start"]).await?;
    Ok(())
}

/// Waits (at most a minute) until every replica has caught up again.
async fn caught_up(fleet: &mut Fleet, config: &Config, rng: &mut StdRng) {
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until && !crate::cluster::fully_replicated(config).await.unwrap_or(false)
    {
        fleet.wait(rng, Duration::from_millis(500)).await;
    }
}

fn pace(plan: &Plan) -> Duration {
    Duration::from_secs_f64(1.0 / plan.rate.max(0.1))
}

async fn http_producer(
    plan: Plan,
    ports: Arc<Mutex<Vec<u16>>>,
    next: Arc<AtomicU64>,
    acknowledged: Arc<Mutex<Acknowledged>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 1);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    while !stop.load(Ordering::SeqCst) {
        let n = next.fetch_add(1, Ordering::SeqCst);
        let (document, version) = target(n);
        let body = json!({"document_id": document, "kind": "index-document",
                          "input_version": version, "input": input(&mut rng, n)})
        .to_string();
        let key = format!("http-{n}");
        // Retried with the same key until answered: the answer is the acknowledgment.
        loop {
            let port = ports.lock().expect("ports").first().copied();
            let answer = match port {
                Some(port) => client
                    .post(format!("http://127.0.0.1:{port}/v1/jobs"))
                    .header("content-type", "application/json")
                    .header("idempotency-key", &key)
                    .body(body.clone())
                    .send()
                    .await
                    .ok(),
                None => None,
            };
            if let Some(answer) = answer
                && matches!(answer.status().as_u16(), 200 | 201)
                && let Ok(created) = answer.json::<serde_json::Value>().await
                && let Some(id) = created["job_id"].as_str().and_then(|s| Uuid::parse_str(s).ok())
            {
                acknowledged.lock().expect("acknowledged").jobs.push(id);
                break;
            }
            ports.lock().expect("ports").rotate_left(1);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(pace(&plan)).await;
    }
    Ok(())
}

async fn api_producer(
    plan: Plan,
    config: Config,
    pool: PgPool,
    next: Arc<AtomicU64>,
    acknowledged: Arc<Mutex<Acknowledged>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 2);
    let codec = Codec::connect(config.registry()?, &config.topics.events).await?;
    let acceptor = jobfold_common::accept::Acceptor::new(codec, config.accept_policy(), "campaign");
    while !stop.load(Ordering::SeqCst) {
        let n = next.fetch_add(1, Ordering::SeqCst);
        let (document, version) = target(n);
        let job = NewJob {
            document_id: document,
            kind: "index-document".into(),
            input_version: version,
            input: input(&mut rng, n),
            idempotency_key: Some(format!("api-{n}")),
            trace: None,
            run_at: None,
        };
        // A commit lost with its connection is ambiguous: the retry with the same key
        // finds the job or makes it, and only an answer counts as acknowledged.
        loop {
            match acceptor.accept(&pool, &job).await {
                Ok(accepted) => {
                    acknowledged.lock().expect("acknowledged").jobs.push(accepted.job_id);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        tokio::time::sleep(pace(&plan)).await;
    }
    Ok(())
}

async fn intake_producer(
    plan: Plan,
    config: Config,
    next: Arc<AtomicU64>,
    acknowledged: Arc<Mutex<Acknowledged>>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 3);
    let codec = Codec::<JobRequest>::connect(config.registry()?, &config.topics.requests).await?;
    let producer: FutureProducer = config
        .kafka_client_for(
            jobfold_common::config::KafkaRole::Producer,
            jobfold_relay::publish::PRODUCER_DEFAULTS,
        )
        .set("message.timeout.ms", "120000")
        .create()?;
    let mut deliveries = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let n = next.fetch_add(1, Ordering::SeqCst);
        let (document, version) = target(n);
        let request = JobRequest {
            request_id: Uuid::now_v7(),
            document_id: document.clone(),
            job_kind: "index-document".into(),
            input_version: version,
            input: input(&mut rng, n).to_string(),
            requested_at: chrono::Utc::now(),
            producer: "campaign".into(),
            trace: None,
            run_at: None,
        };
        let body = codec.encode(&request)?;
        let record = FutureRecord::to(&config.topics.requests).key(&document).payload(&body);
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push((request.request_id, delivery)),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
        // An upstream producer resends what was not acknowledged; here, only acknowledged
        // requests are expected to become jobs.
        let mut still = Vec::new();
        for (id, mut delivery) in deliveries.drain(..) {
            match futures::poll!(&mut delivery) {
                std::task::Poll::Ready(Ok(Ok(_))) => {
                    acknowledged.lock().expect("acknowledged").acknowledge_request(id)
                }
                std::task::Poll::Ready(_) => {}
                std::task::Poll::Pending => still.push((id, delivery)),
            }
        }
        deliveries = still;
        tokio::time::sleep(pace(&plan)).await;
    }
    for (id, delivery) in deliveries {
        if let Ok(Ok(_)) = delivery.await {
            acknowledged.lock().expect("acknowledged").acknowledge_request(id);
        }
    }
    Ok(())
}

/// Why a process exited, from its log: the last `Error:` and its causes, up to the
/// backtrace, else the last four lines.
fn exit_reason(log: &str) -> Vec<&str> {
    let lines: Vec<&str> = log.lines().collect();
    match lines.iter().rposition(|line| line.starts_with("Error:")) {
        Some(at) => lines[at..]
            .iter()
            .take_while(|line| !line.starts_with("Stack backtrace"))
            .filter(|line| !line.trim().is_empty())
            .take(8)
            .copied()
            .collect(),
        None => lines[lines.len().saturating_sub(4)..].to_vec(),
    }
}
