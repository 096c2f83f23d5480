//! `jobfold demo`: the whole pipeline on this machine, a processor killed midway, and a
//! summary that checks the run.
//!
//! It starts what is not running yet (the native Postgres, Kafka and registry scripts
//! under `docker/`; without Java, librdkafka's in-process mock cluster as Kafka), creates a
//! database and topics of its own, starts a relay and two processors as separate processes,
//! waits until both processors hold partitions, submits document-indexing jobs over HTTP
//! spread over a fixed time, shows live progress, kills with SIGKILL the processor that holds
//! partitions and running jobs at that moment, waits for every job to settle and checks the
//! outcome from Postgres and the log.
//! Ctrl-C stops everything it started.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use jobfold_cli::analytics::{self, Options, Source};
use jobfold_common::config::{Config, Sensitive};
use jobfold_common::gauges;
use jobfold_schemas::{Decoder, JobEvent};
use rand::Rng;
use serde_json::json;
use sqlx::PgPool;
use tokio::process::{Child, Command};

/// The processors' lease in the demo: a dead worker's jobs move on within seconds.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(4);
/// The processes' heartbeat: a quarter of [`LEASE_TTL`].
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(1);
/// How long both processors may take to hold partitions before the workload starts.
const GROUP_SETTLE: Duration = Duration::from_secs(45);
/// How long the submissions are spread over, so the kill lands while jobs run however fast
/// the machine: the full run, and `--short`.
pub(crate) const WORKLOAD: Duration = Duration::from_secs(12);
pub(crate) const SHORT_WORKLOAD: Duration = Duration::from_secs(7);

/// The processor killed midway: what it held then, and when the other took over.
#[derive(Debug)]
struct Kill {
    name: &'static str,
    survivor: &'static str,
    survivor_index: usize,
    partitions: usize,
    in_flight: i64,
    at: Instant,
    taken_over: Option<Duration>,
}

/// How big a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Size {
    pub(crate) documents: usize,
    /// Stop as soon as the summary is printed (tests), instead of running until Ctrl-C.
    pub(crate) exit: bool,
    /// How long the submissions are spread over ([`WORKLOAD`], [`SHORT_WORKLOAD`]).
    pub(crate) pace: Duration,
}

/// Which Kafka to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum KafkaChoice {
    /// The configured brokers if they answer, else the native broker (Java), else the mock.
    Auto,
    /// librdkafka's in-process mock cluster.
    Mock,
}

/// One started child process.
pub(crate) struct Process {
    pub(crate) child: Child,
    log: PathBuf,
    pub(crate) http: u16,
    pub(crate) metrics: u16,
}

/// The sum of metric `name` over the series whose labels contain `labels` (`""` for all),
/// from a process's `/metrics`; `None` if it could not be read.
pub(crate) async fn metric_sum(port: u16, name: &str, labels: &str) -> Option<f64> {
    let text =
        reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await.ok()?.text().await.ok()?;
    let values = text
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(labels))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok());
    Some(values.sum())
}

/// What the demo started, stopped again at the end.
#[derive(Default)]
struct Started {
    scripts: Vec<(PathBuf, &'static str)>,
    processes: Vec<Process>,
}

impl Started {
    async fn stop(&mut self) {
        for p in &mut self.processes {
            if let Some(pid) = p.child.id() {
                let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status().await;
            }
        }
        for p in &mut self.processes {
            if tokio::time::timeout(Duration::from_secs(15), p.child.wait()).await.is_err() {
                let _ = p.child.kill().await;
            }
        }
        for (root, service) in self.scripts.iter().rev() {
            let script = root.join(format!("docker/{service}.sh"));
            let _ = Command::new("bash").arg(script).arg("stop").status().await;
        }
    }
}

/// Runs the demo; `Ok` when every check of the summary held.
pub(crate) async fn run(config: Config, size: Size, kafka: KafkaChoice) -> anyhow::Result<()> {
    let mut started = Started::default();
    let result = tokio::select! {
        result = demo(config, size, kafka, &mut started) => result,
        _ = tokio::signal::ctrl_c() => {
            println!("\nCtrl-C: stopping everything the demo started.");
            Ok(())
        }
    };
    started.stop().await;
    if !started.processes.is_empty() || !started.scripts.is_empty() {
        println!("Stopped what the demo started.");
    }
    result
}

async fn demo(
    mut config: Config,
    size: Size,
    kafka: KafkaChoice,
    started: &mut Started,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    println!("jobfold demo: conversation summaries, end to end, with a processor killed midway.\n");

    // 1. Services, for topics and groups of the demo's own.
    let run_id = chrono::Utc::now().format("%Y%m%d%H%M%S").to_string();
    config.topics.events = format!("jobfold-demo-{run_id}.job-events");
    config.topics.requests = format!("jobfold-demo-{run_id}.job-requests");
    config.processor.group = format!("jobfold-demo-{run_id}-processors");
    config.intake.group = format!("jobfold-demo-{run_id}-intake");
    config.relay.lock_key = i64::from(rand::random::<u32>());
    let root = repository_root();
    let _mock = services(&mut config, kafka, root.as_deref(), started).await?;

    // 2. A database of the demo's own.
    let admin = jobfold_common::db::connect(&config, 1).await?;
    let database = format!("jobfold_demo_{run_id}");
    jobfold_common::db::create_database(&admin, &database).await?;
    admin.close().await;
    let url = jobfold_common::pg_hosts::with_database(config.database_url.expose(), &database)
        .map_err(|problem| anyhow::anyhow!("database_url: {problem}"))?;
    config.database_url = Sensitive::new(url);
    let pool = jobfold_common::db::connect_and_migrate(&config, 4).await?;
    jobfold_common::kafka::ensure_topics(&config, &jobfold_common::kafka::jobfold_topics(&config))
        .await?;
    println!(
        "database {database}, topics {} ({} partitions)",
        config.topics.events, config.topics.partitions
    );

    // 3. Two relays and two processors, separate processes.
    let plan = plan(size.documents);
    let planned = plan.len();
    // The model the summaries come from: a stand-in on 127.0.0.1, as slow and as busy as
    // planned per conversation.
    let model = crate::model::Model::start(crate::model::Behaviour {
        latency: Duration::from_millis(200),
        fail_first: 0,
    })
    .await?;
    for job in &plan {
        let behaviour = crate::model::Behaviour {
            latency: Duration::from_millis(job.latency_ms),
            fail_first: job.busy_calls,
        };
        model.plan(&job.document, behaviour);
    }
    let audio = logs_dir(&run_id);
    let processor_args = [
        "--model-url".to_owned(),
        model.url.clone(),
        "--audio-input".to_owned(),
        audio.join("audio-in").display().to_string(),
        "--audio-output".to_owned(),
        audio.join("audio-out").display().to_string(),
    ];
    let logs = logs_dir(&run_id);
    std::fs::create_dir_all(&logs)?;
    let bin = std::env::current_exe()?.parent().context("the binary's directory")?.to_path_buf();
    for (name, binary) in [
        ("relay-1", "jobfold-relay"),
        ("processor-a", "jobfold-examples"),
        ("processor-b", "jobfold-examples"),
        ("relay-2", "jobfold-relay"),
    ] {
        let args: &[String] = if binary == "jobfold-examples" { &processor_args } else { &[] };
        let process = spawn(&config, &bin.join(binary), name, &logs, args)?;
        println!(
            "started {name:<12} pid {:>7}  log {}",
            process.child.id().unwrap_or(0),
            process.log.display()
        );
        if name == "relay-1" {
            // relay-1 holds the lock before relay-2 starts, which then stands by.
            let deadline = Instant::now() + Duration::from_secs(60);
            while count_lines(&process.log, "Active: relaying") == 0 {
                anyhow::ensure!(Instant::now() < deadline, "relay-1 did not become active");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        started.processes.push(process);
    }
    for p in &started.processes[1..3] {
        wait_ready(p.http).await?;
    }
    println!("services up after {:.1} s", t0.elapsed().as_secs_f64());
    // Both processors hold partitions before any job is submitted: otherwise one may take
    // the whole workload and killing the other would show nothing.
    let processors = [("processor-a", 1), ("processor-b", 2)];
    let all_partitions = config.topics.partitions as usize;
    let settle = Instant::now();
    let split = loop {
        let mut held = [0; 2];
        for (slot, (_, i)) in processors.iter().enumerate() {
            held[slot] = assigned_partitions(started.processes[*i].metrics).await.unwrap_or(0);
        }
        if held.iter().all(|&n| n > 0) && held.iter().sum::<usize>() == all_partitions {
            println!(
                "consumer group {}: processor-a holds {} partitions, processor-b {} ({:.1} s)\n",
                config.processor.group,
                held[0],
                held[1],
                settle.elapsed().as_secs_f64()
            );
            break true;
        }
        if settle.elapsed() >= GROUP_SETTLE {
            println!(
                "\n>>> the consumer group did not give both processors partitions within {:?} \
                 (processor-a holds {}, processor-b {} of {all_partitions}): the broker has not \
                 finished the rebalance, so a processor killed now may hold no work; the demo \
                 goes on, and its kill check will say so.\n",
                GROUP_SETTLE, held[0], held[1]
            );
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // 4. The workload, submitted over HTTP to both processors while they work.
    let ports = [started.processes[1].http, started.processes[2].http];
    println!(
        "submitting {planned} summarize-conversation jobs for {} conversations: 1-3 versions each, {} invalid, {} meeting a busy model (503, Retry-After), idempotent retries of {}\n",
        size.documents,
        plan.iter().filter(|j| j.invalid).count(),
        plan.iter().filter(|j| j.busy_calls > 0).count(),
        plan.iter().filter(|j| j.retry_submit).count(),
    );
    let mut submitter = Some(tokio::spawn(submit(plan, ports, size.pace)));
    // relay-1 crashes between producing a batch and marking it, early in the workload:
    // relay-2, standing by, takes over and publishes those events again.
    let relay_1 = started.processes[0].child.id().context("relay-1's pid")?;
    let mut relay_crash = Some(tokio::spawn(crash_relay_before_its_mark(pool.clone(), relay_1)));

    // 5. Live progress. Once a third of the jobs ended, kill -9 the processor that holds
    //    work at that moment: partitions and leased jobs, read from its metrics and Postgres.
    let terminal = std::io::stdout().is_terminal();
    let mut metrics = MetricsSeen::default();
    let mut killed: Option<Kill> = None;
    let mut relay_crashed = false;
    let mut last_line = Instant::now() - Duration::from_secs(10);
    let mut submitted: Option<Submitted> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(handle) = submitter.take_if(|h| h.is_finished()) {
            submitted = Some(handle.await.context("the submitter panicked")??);
        }
        let progress = Progress::read(&pool).await?;
        for (i, p) in started.processes.iter().enumerate().skip(1) {
            if let Some(text) = scrape(p.metrics).await {
                metrics.update(i, &text);
            }
        }
        let line = progress.line(&metrics);
        if terminal {
            print!("\r\x1b[2K{line}");
            let _ = std::io::Write::flush(&mut std::io::stdout());
        } else if last_line.elapsed() >= Duration::from_secs(2) {
            println!("{line}");
            last_line = Instant::now();
        }
        if let Some(handle) = relay_crash.take_if(|h| h.is_finished()) {
            handle.await.context("crashing relay-1 panicked")??;
        }
        if !relay_crashed && let Ok(Some(status)) = started.processes[0].child.try_wait() {
            relay_crashed = true;
            if terminal {
                println!();
            }
            println!(
                "\n>>> relay-1 crashed between producing a batch and marking it ({status}: killed while its mark waited on the cursor, which the demo held): relay-2 takes the lock and publishes those events again — duplicates the processors must skip\n"
            );
        }
        if killed.is_none() && progress.ended() * 3 >= planned {
            let leased = leased_by_pid(&pool).await?;
            let mut candidates = Vec::new();
            for (name, i) in processors {
                let process = &started.processes[i];
                let pid = process.child.id().unwrap_or(0);
                let partitions = assigned_partitions(process.metrics).await.unwrap_or(0);
                let in_flight = leased.get(&pid).copied().unwrap_or(0);
                if partitions > 0 && in_flight > 0 {
                    candidates.push((in_flight, partitions, name, i, pid));
                }
            }
            // The one with the most jobs running; none running now: look again next tick.
            if let Some(&(in_flight, partitions, name, i, pid)) = candidates.iter().max() {
                started.processes[i].child.start_kill()?;
                let (survivor, survivor_index) =
                    processors.into_iter().find(|(_, j)| *j != i).expect("two processors");
                if terminal {
                    println!();
                }
                println!(
                    "\n>>> kill -9 {name} (pid {pid}) holding {partitions} partitions and {in_flight} jobs in flight, with {} jobs ended of {planned}: its leases expire in {:?}, its partitions move to {survivor} after the session timeout\n",
                    progress.ended(),
                    LEASE_TTL
                );
                killed = Some(Kill {
                    name,
                    survivor,
                    survivor_index,
                    partitions,
                    in_flight,
                    at: Instant::now(),
                    taken_over: None,
                });
            }
        }
        if let Some(kill) = &mut killed
            && kill.taken_over.is_none()
            && assigned_partitions(started.processes[kill.survivor_index].metrics).await
                == Some(all_partitions)
        {
            kill.taken_over = Some(kill.at.elapsed());
            if terminal {
                println!();
            }
            println!(
                "\n>>> {} took over {}'s partitions {:.1} s after the kill: it holds all {all_partitions}\n",
                kill.survivor,
                kill.name,
                kill.at.elapsed().as_secs_f64()
            );
        }
        if let Some(s) = &submitted
            && progress.ended() as u64 == s.accepted
            && progress.unpublished == 0
        {
            if terminal {
                println!("\r\x1b[2K{}", progress.line(&metrics));
            } else {
                println!("{}", progress.line(&metrics));
            }
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(600),
            "the jobs did not settle within 10 minutes; logs in {}",
            logs.display()
        );
    }

    // 6. The summary, checked.
    let mut submitted = submitted.expect("set before the loop ends");
    submitted.model_calls = model.calls();
    let ok =
        summary(&config, &pool, &submitted, &metrics, t0.elapsed(), killed.as_ref(), split).await?;

    // 7. Where to look next.
    let (survivor, a) = match &killed {
        Some(kill) => (kill.survivor, &started.processes[kill.survivor_index]),
        None => ("processor-a", &started.processes[1]),
    };
    println!("\nWhere to look next ({survivor} keeps serving until Ctrl-C):");
    println!("  console        http://127.0.0.1:{}/ui/#/jobs/{}", a.http, submitted.sample_job);
    println!("  metrics        http://127.0.0.1:{}/metrics", a.metrics);
    println!("  status API     http://127.0.0.1:{}/v1/jobs/{}", a.http, submitted.sample_job);
    println!(
        "  events API     http://127.0.0.1:{}/v1/jobs/{}/events",
        a.http, submitted.sample_job
    );
    println!("  quarantine     http://127.0.0.1:{}/v1/quarantine", a.http);
    println!("  with this environment:");
    println!(
        "    export JOBFOLD_DATABASE_URL='{}' JOBFOLD_KAFKA_BROKERS='{}' JOBFOLD_SCHEMA_REGISTRY_URL='{}' JOBFOLD_TOPICS__EVENTS='{}'",
        config.database_url.expose(),
        config.kafka_brokers,
        config.schema_registry_url,
        config.topics.events
    );
    println!(
        "  jobfold stats | jobfold quarantine list | jobfold replay --verify | jobfold status JOB_ID"
    );
    println!("  logs           {}", logs.display());
    if !ok {
        anyhow::bail!("a check of the summary failed; logs in {}", logs.display());
    }
    if !size.exit {
        println!("\nRunning until Ctrl-C.");
        std::future::pending::<()>().await;
    }
    Ok(())
}

/// The checkout holding `docker/`: `JOBFOLD_ROOT`, else above the binary, else here.
fn repository_root() -> Option<PathBuf> {
    let candidates = std::env::var_os("JOBFOLD_ROOT")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::current_exe().ok().into_iter().flat_map(|exe| {
            exe.ancestors().skip(1).take(4).map(Path::to_path_buf).collect::<Vec<_>>()
        }))
        .chain(std::env::current_dir().ok());
    candidates.into_iter().find(|dir| dir.join("docker/services.sh").is_file())
}

fn reachable(host_port: &str) -> bool {
    use std::net::ToSocketAddrs;
    host_port
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .any(|addr| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok())
}

fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority.rsplit_once('@').map_or(authority, |(_, hp)| hp).to_owned()
}

/// Starts what does not answer yet; returns the mock cluster if Kafka is the mock.
async fn services(
    config: &mut Config,
    kafka: KafkaChoice,
    root: Option<&Path>,
    started: &mut Started,
) -> anyhow::Result<
    Option<rdkafka::mocking::MockCluster<'static, rdkafka::producer::DefaultProducerContext>>,
> {
    // What does not answer yet is started by its script, all side by side (Kafka's and the
    // registry's JVMs take the longest).
    let mut to_start: Vec<&'static str> = Vec::new();
    if reachable(&host_port(config.database_url.expose())) {
        println!("postgres: using {}", host_port(config.database_url.expose()));
    } else {
        to_start.push("postgres");
    }
    let mut mock = None;
    let brokers_up = config.kafka_brokers.split(',').any(reachable);
    let java = std::process::Command::new("java")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if kafka == KafkaChoice::Mock || (!brokers_up && !java) {
        let cluster = rdkafka::mocking::MockCluster::new(1).context("starting the mock cluster")?;
        config.kafka_brokers = cluster.bootstrap_servers();
        println!(
            "kafka: librdkafka's in-process MOCK cluster at {} ({}) — not a real broker; install Java 17 and Maven for Apache Kafka",
            config.kafka_brokers,
            if kafka == KafkaChoice::Mock {
                "asked for with --kafka mock"
            } else {
                "Java is missing"
            }
        );
        // The mock answers no CreateTopics: its topics are made here, and every client
        // finds them existing.
        let partitions = config.topics.partitions;
        for topic in [&config.topics.events, &config.topics.requests] {
            cluster.create_topic(topic, partitions, 1).context("creating a mock topic")?;
        }
        mock = Some(cluster);
    } else if brokers_up {
        println!("kafka: using {}", config.kafka_brokers);
    } else {
        to_start.push("kafka");
    }
    if reachable(&host_port(config.schema_registry_url.expose())) {
        println!("registry: using {}", config.schema_registry_url);
    } else {
        to_start.push("registry");
    }
    if to_start.is_empty() {
        return Ok(mock);
    }
    let root = root.context(
        "services are not running and docker/ was not found: run the demo from the jobfold checkout (or set JOBFOLD_ROOT)",
    )?;
    // Child processes awaited here, so Ctrl-C stops the demo even while a service starts.
    started.scripts.extend(to_start.iter().map(|service| (root.to_path_buf(), *service)));
    let runs = to_start.iter().map(|service| {
        Command::new("bash").arg(root.join(format!("docker/{service}.sh"))).arg("start").status()
    });
    for (service, status) in to_start.iter().zip(futures::future::join_all(runs).await) {
        anyhow::ensure!(status?.success(), "docker/{service}.sh start failed");
    }
    Ok(mock)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) fn spawn(
    config: &Config,
    binary: &Path,
    name: &str,
    logs: &Path,
    args: &[String],
) -> anyhow::Result<Process> {
    let (http, metrics) = (free_port()?, free_port()?);
    let log = logs.join(format!("{name}.log"));
    let file = std::fs::File::create(&log)?;
    let mut command = Command::new(binary);
    if let Some(user) = &config.schema_registry_username {
        command.env("JOBFOLD_SCHEMA_REGISTRY_USERNAME", user);
    }
    if let Some(password) = &config.schema_registry_password {
        command.env("JOBFOLD_SCHEMA_REGISTRY_PASSWORD", password.expose());
    }
    if let Some(token) = &config.schema_registry_token {
        command.env("JOBFOLD_SCHEMA_REGISTRY_TOKEN", token.expose());
    }
    command
        .args(args)
        .env("JOBFOLD_DATABASE_URL", config.database_url.expose())
        .env("JOBFOLD_KAFKA_BROKERS", &config.kafka_brokers)
        .env("JOBFOLD_SCHEMA_REGISTRY_URL", config.schema_registry_url.expose())
        .env("JOBFOLD_TOPICS__EVENTS", &config.topics.events)
        .env("JOBFOLD_TOPICS__REQUESTS", &config.topics.requests)
        .env("JOBFOLD_PROCESSOR__GROUP", &config.processor.group)
        .env("JOBFOLD_PROCESSOR__MAX_IN_FLIGHT", config.processor.max_in_flight.to_string())
        .env("JOBFOLD_INTAKE__GROUP", &config.intake.group)
        .env("JOBFOLD_RELAY__LOCK_KEY", config.relay.lock_key.to_string())
        // The database as configured: a primary and its standby are followed alike.
        .env(
            "JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY",
            config.database.require_sync_standby.to_string(),
        )
        .env(
            "JOBFOLD_DATABASE__PRIMARY_CHECK",
            format!("{}ms", config.database.primary_check.as_millis()),
        )
        .env(
            "JOBFOLD_ACCEPT__COMMIT_TIMEOUT",
            format!("{}ms", config.accept.commit_timeout.as_millis()),
        )
        .env("JOBFOLD_HTTP_ADDR", format!("127.0.0.1:{http}"))
        .env("JOBFOLD_METRICS_ADDR", format!("127.0.0.1:{metrics}"))
        // Demo timings: a dead worker's jobs move on within seconds.
        .env("JOBFOLD_PROCESSOR__LEASE_TTL", format!("{}s", LEASE_TTL.as_secs()))
        .env("JOBFOLD_PROCESSOR__HEARTBEAT", format!("{}ms", HEARTBEAT.as_millis()))
        .env("JOBFOLD_PROCESSOR__REAPER_INTERVAL", "1s")
        .env("JOBFOLD_PROCESSOR__REAPER_GRACE", "1s")
        .env("JOBFOLD_PROCESSOR__RETRY_BASE", "200ms")
        .env("JOBFOLD_PROCESSOR__RETRY_CAP", "1s")
        .env("JOBFOLD_PROCESSOR__GAUGE_INTERVAL", "500ms")
        .env("JOBFOLD_RELAY__POLL_INTERVAL", "200ms")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .kill_on_drop(true);
    if name.starts_with("processor") {
        // A killed member's partitions move after 6 s (the broker's minimum), not 45 s.
        command.env("JOBFOLD_KAFKA__SESSION_TIMEOUT_MS", "6000");
    }
    // Retention as configured (the soak turns it on).
    for (name, after) in config.retention.sweeps() {
        let key = format!("JOBFOLD_RETENTION__{}_AFTER", name.to_uppercase());
        command.env(key, format!("{}ms", after.as_millis()));
    }
    command
        .env("JOBFOLD_RETENTION__INTERVAL", format!("{}ms", config.retention.interval.as_millis()));
    for (key, value) in &config.kafka.0 {
        command.env(format!("JOBFOLD_KAFKA__{}", key.replace('.', "_").to_uppercase()), value);
    }
    let child = command.spawn().with_context(|| format!("starting {}", binary.display()))?;
    Ok(Process { child, log, http, metrics })
}

pub(crate) async fn wait_ready(http: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{http}/readyz")).await
            && r.status().is_success()
        {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "a processor did not become ready in 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One job to submit.
#[derive(Debug, Clone)]
struct Planned {
    document: String,
    version: i64,
    invalid: bool,
    /// The model answers 503 to this many calls of the job first.
    busy_calls: u32,
    /// The model takes this long per call.
    latency_ms: u64,
    /// Submit it a second time with the same Idempotency-Key.
    retry_submit: bool,
}

fn plan(documents: usize) -> Vec<Planned> {
    let mut rng = rand::rng();
    let mut jobs = Vec::new();
    for d in 0..documents {
        let versions = rng.random_range(1..=3);
        for version in 1..=versions {
            jobs.push(Planned {
                document: format!("conversation-{d:04}"),
                version,
                invalid: d % 20 == 7 && version == 1,
                busy_calls: if d % 10 == 3 { rng.random_range(1..=2) } else { 0 },
                latency_ms: rng.random_range(100..600),
                retry_submit: d % 12 == 5,
            });
        }
    }
    jobs
}

/// What the submitter did.
#[derive(Debug, Clone)]
struct Submitted {
    accepted: u64,
    idempotent_replays: u64,
    sample_job: String,
    /// The calls the model saw, read once every job ended.
    model_calls: Vec<crate::model::Call>,
}

async fn submit(plan: Vec<Planned>, ports: [u16; 2], pace: Duration) -> anyhow::Result<Submitted> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let mut out = Submitted {
        accepted: 0,
        idempotent_replays: 0,
        sample_job: String::new(),
        model_calls: Vec::new(),
    };
    // Spread over `pace`, each job due at its share of it, so the kill lands while jobs
    // run: on a fast machine the workload lasts as long, on a slow one it is not longer.
    let started = Instant::now();
    let step = pace / u32::try_from(plan.len().max(1)).unwrap_or(u32::MAX);
    for (i, job) in plan.iter().enumerate() {
        let due = started + step * u32::try_from(i).unwrap_or(u32::MAX);
        tokio::time::sleep_until(due.into()).await;
        let input = if job.invalid {
            json!({"messages": []})
        } else {
            // Each version of a conversation has one more exchange.
            let mut messages = vec![json!({"role": "user",
                "content": format!("{}: my order has not arrived", job.document)})];
            for turn in 1..job.version {
                messages.push(json!({"role": "assistant", "content": format!("Reply {turn}: we are looking into it.")}));
                messages.push(json!({"role": "user", "content": "Then I want a refund."}));
            }
            json!({"messages": messages})
        };
        let body = json!({"document_id": job.document, "kind": "summarize-conversation",
                          "input_version": job.version, "input": input});
        let key = format!("demo-{}-v{}", job.document, job.version);
        for attempt in 0..if job.retry_submit { 2 } else { 1 } {
            // Alternate between the processors. A request to one that dies (refused, or cut
            // off mid-request) goes to the other: the Idempotency-Key makes the retry safe,
            // and an accepted first try answers 200 the second time.
            let mut response = None;
            let deadline = Instant::now() + Duration::from_secs(30);
            'send: while Instant::now() < deadline {
                for port in [ports[(i + attempt) % 2], ports[(i + attempt + 1) % 2]] {
                    if let Ok(r) = client
                        .post(format!("http://127.0.0.1:{port}/v1/jobs"))
                        .header("content-type", "application/json")
                        .header("idempotency-key", &key)
                        .body(body.to_string())
                        .send()
                        .await
                    {
                        response = Some(r);
                        break 'send;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let response = response.context("no processor answers HTTP")?;
            // The first submission's answer — 201, or 200 if a try cut off above was
            // accepted — means one job; the deliberate resubmission must answer 200.
            match (attempt, response.status().as_u16()) {
                (0, 200 | 201) => {
                    out.accepted += 1;
                    let created: serde_json::Value = response.json().await?;
                    if out.sample_job.is_empty() {
                        out.sample_job = created["job_id"].as_str().unwrap_or_default().to_owned();
                    }
                }
                (_, 200) => out.idempotent_replays += 1,
                (_, 201) => anyhow::bail!("resubmitting {key} created a second job"),
                (_, status) => {
                    anyhow::bail!("submitting {key}: HTTP {status}: {}", response.text().await?)
                }
            }
        }
    }
    Ok(out)
}

/// Counts from Postgres.
#[derive(Debug, Default)]
struct Progress {
    states: BTreeMap<String, i64>,
    unpublished: i64,
    published: i64,
}

impl Progress {
    async fn read(pool: &PgPool) -> anyhow::Result<Self> {
        let states = gauges::totals(pool).await?;
        // Published: events on Kafka — every event of the log but those the relay still owes
        // (after its cursor, waiting in the outbox, or parked).
        let unpublished = gauges::unpublished(pool).await?;
        let events = sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM job_events"#)
            .fetch_one(pool)
            .await?;
        Ok(Self { states, unpublished, published: events - unpublished })
    }

    fn get(&self, state: &str) -> i64 {
        self.states.get(state).copied().unwrap_or(0)
    }

    fn accepted(&self) -> i64 {
        self.states.values().sum()
    }

    fn ended(&self) -> usize {
        usize::try_from(self.get("succeeded") + self.get("quarantined") + self.get("superseded"))
            .unwrap_or(0)
    }

    fn line(&self, m: &MetricsSeen) -> String {
        format!(
            "accepted {:>4} | published {:>5} | in flight {:>3} | succeeded {:>4} | retrying {:>3} | quarantined {:>3} | superseded {:>3} | duplicates skipped {:>3}",
            self.accepted(),
            self.published,
            self.get("leased"),
            self.get("succeeded"),
            self.get("retry_wait"),
            self.get("quarantined"),
            self.get("superseded"),
            m.sum("jobfold_duplicates_skipped_total"),
        )
    }
}

/// The last counter values scraped from each processor (a killed one keeps its last).
#[derive(Debug, Default)]
struct MetricsSeen {
    by_process: BTreeMap<usize, BTreeMap<String, f64>>,
}

const COUNTERS: [&str; 4] = [
    "jobfold_duplicates_skipped_total",
    "jobfold_fenced_completions_total",
    "jobfold_handler_runs_total",
    "jobfold_completed_total",
];

impl MetricsSeen {
    fn update(&mut self, process: usize, text: &str) {
        let values = self.by_process.entry(process).or_default();
        for name in COUNTERS {
            let total: f64 = text
                .lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (series, value) = l.rsplit_once(' ')?;
                    let metric = series.split('{').next()?;
                    (metric == name).then(|| value.parse::<f64>().ok()).flatten()
                })
                .sum();
            values.insert(name.to_owned(), total);
        }
    }

    fn sum(&self, name: &str) -> u64 {
        self.by_process.values().filter_map(|v| v.get(name)).sum::<f64>() as u64
    }
}

async fn scrape(port: u16) -> Option<String> {
    let client = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().ok()?;
    client.get(format!("http://127.0.0.1:{port}/metrics")).send().await.ok()?.text().await.ok()
}

/// The partitions a processor holds, from its `/metrics`; `None` if it does not answer.
async fn assigned_partitions(metrics_port: u16) -> Option<usize> {
    let text = scrape(metrics_port).await?;
    let value = text.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (series == jobfold_processor::metrics::ASSIGNED_PARTITIONS).then_some(value)
    });
    Some(value.and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as usize)
}

/// Jobs under a live lease, by the pid of the processor holding it (leases are owned by
/// `host/pid`).
async fn leased_by_pid(pool: &PgPool) -> anyhow::Result<BTreeMap<u32, i64>> {
    let rows = sqlx::query!(
        r#"SELECT lease_owner AS "owner!", count(*) AS "count!" FROM jobs
           WHERE state = 'leased' AND lease_until > now() AND lease_owner IS NOT NULL
           GROUP BY lease_owner"#,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| Some((r.owner.rsplit_once('/')?.1.parse().ok()?, r.count)))
        .collect())
}

fn count_lines(log: &Path, needle: &str) -> usize {
    std::fs::read_to_string(log).map(|t| t.matches(needle).count()).unwrap_or(0)
}

/// Prints the checks of this run; whether all held.
async fn summary(
    config: &Config,
    pool: &PgPool,
    submitted: &Submitted,
    metrics: &MetricsSeen,
    took: Duration,
    killed: Option<&Kill>,
    split: bool,
) -> anyhow::Result<bool> {
    let progress = Progress::read(pool).await?;
    let check = |ok: bool| if ok { "ok  " } else { "FAIL" };
    let mut all = true;
    let mut line = |ok: bool, text: String| {
        all &= ok;
        println!("  [{}] {text}", check(ok));
    };
    println!("\nSummary ({:.1} s)", took.as_secs_f64());
    let (s, q, x) =
        (progress.get("succeeded"), progress.get("quarantined"), progress.get("superseded"));
    let accepted = i64::try_from(submitted.accepted).unwrap_or(i64::MAX);
    line(
        s + q + x == accepted && progress.accepted() == accepted,
        format!(
            "every accepted job accounted for: {accepted} accepted = {s} succeeded + {q} quarantined + {x} superseded ({} idempotent resubmissions answered 200, no new job)",
            submitted.idempotent_replays
        ),
    );
    // The business effect outside Postgres is the model call: after a job's summary
    // committed, a redelivery must be stopped by the job row (its dispatch version and state)
    // before the handler runs.
    let committed = sqlx::query!(
        r#"SELECT j.job_id::text || ':' || j.input_version AS "key!", e.occurred_at
           FROM job_events e JOIN jobs j USING (job_id) WHERE e.kind = 'JobSucceeded'"#,
    )
    .fetch_all(pool)
    .await?;
    let committed: BTreeMap<String, chrono::DateTime<chrono::Utc>> =
        committed.into_iter().map(|r| (r.key, r.occurred_at)).collect();
    let calls = &submitted.model_calls;
    let late = calls.iter().filter(|c| committed.get(&c.key).is_some_and(|at| c.at > *at)).count();
    line(
        late == 0,
        format!(
            "{late} duplicate business writes: no model call after its summary committed ({} calls for {s} succeeded jobs, busy answers and retries included)",
            calls.len()
        ),
    );
    match killed {
        Some(kill) => line(
            kill.partitions > 0 && kill.in_flight > 0 && kill.taken_over.is_some(),
            format!(
                "{} was killed with SIGKILL holding {} partitions and {} jobs in flight, and {} took over its partitions{}",
                kill.name,
                kill.partitions,
                kill.in_flight,
                kill.survivor,
                kill.taken_over
                    .map(|t| format!(" {:.1} s later", t.as_secs_f64()))
                    .unwrap_or_else(|| " (not seen)".into()),
            ),
        ),
        None if !split => line(
            false,
            format!(
                "no processor was killed: the consumer group never gave both processors partitions within {GROUP_SETTLE:?}, so no kill could show a take-over"
            ),
        ),
        None => line(
            false,
            "no processor was killed: neither held partitions and jobs in flight at once while the workload ran".into(),
        ),
    }
    let counted = sqlx::query!(
        r#"
        WITH best AS (
            SELECT document_id, max(input_version) AS v FROM jobs
            WHERE state = 'succeeded' GROUP BY document_id
        )
        SELECT count(*) AS "documents!",
               count(*) FILTER (WHERE d.version IS DISTINCT FROM b.v) AS "wrong!"
        FROM best b LEFT JOIN conversation_summaries d ON d.conversation_id = b.document_id
        "#,
    )
    .fetch_one(pool)
    .await?;
    let (documents, wrong) = (counted.documents, counted.wrong);
    line(
        wrong == 0,
        format!(
            "the highest succeeded version is the one summarized for all {documents} conversations ({wrong} wrong)"
        ),
    );
    let decoder = Decoder::<JobEvent>::new(config.registry()?);
    let mut on_topic = 0;
    for source in [Source::Postgres, Source::Kafka] {
        let options = Options { verify: true, ..Options::new(source) };
        let report = analytics::replay(config, pool, &decoder, &options).await?;
        if source == Source::Kafka {
            on_topic = report.duplicates;
        }
        line(
            report.is_clean(),
            format!(
                "replay --verify from {source:?}: {} events fold into the projection, {} differences",
                report.events, report.difference_count
            ),
        );
    }
    line(
        on_topic > 0,
        format!(
            "duplicates delivered: {on_topic} event(s) twice on the topic (the relay crash); the processors skipped {} redelivered dispatches as duplicates and fenced {} completions; {} handler runs",
            metrics.sum("jobfold_duplicates_skipped_total"),
            metrics.sum("jobfold_fenced_completions_total"),
            metrics.sum("jobfold_handler_runs_total"),
        ),
    );
    Ok(all)
}

/// Kills the active relay (`relay`, its pid) between producing a batch and marking it, once
/// it has marked one batch of the workload: the demo holds the cursor's table against
/// writes, the relay's next mark waits on it with its batch already delivered to Kafka, and
/// the relay is killed -9 there. Its session is ended too before the table is let go: a
/// statement the relay sent before it died would otherwise still run once the lock is free
/// (a backend notices its client gone only when it next talks to it). So the mark never
/// happens, the cursor stays before that batch, and the relay standing by publishes it
/// again.
async fn crash_relay_before_its_mark(pool: sqlx::PgPool, relay: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let start =
        sqlx::query_scalar!("SELECT published_seq FROM relay_cursor").fetch_one(&pool).await?;
    while sqlx::query_scalar!("SELECT published_seq FROM relay_cursor").fetch_one(&pool).await?
        == start
    {
        anyhow::ensure!(Instant::now() < deadline, "relay-1 published nothing in 120 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut tx = pool.begin().await?;
    // A table lock, not a row lock: it takes no transaction id, so it does not hold the
    // horizon the relay reads below (which a row lock's id would, and the relay would then
    // read nothing new to produce). SHARE lets reads by, and stops the cursor's update.
    sqlx::query!("LOCK TABLE relay_cursor IN SHARE MODE").execute(&mut *tx).await?;
    let holder =
        sqlx::query_scalar!(r#"SELECT pg_backend_pid() AS "pid!""#).fetch_one(&mut *tx).await?;
    // The relay's mark is the only statement that writes the row: a session waiting on this
    // one is the relay, past its batch's delivery reports. (Looked at from another session:
    // a transaction sees the sessions' activity as it was at its first look.)
    while sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"#,
        holder
    )
    .fetch_one(&pool)
    .await?
        == 0
    {
        anyhow::ensure!(Instant::now() < deadline, "relay-1 did not come to mark a batch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(relay)?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)?;
    // Gone (or a zombie not yet reaped) before its transaction may go on.
    let stat = format!("/proc/{relay}/stat");
    while std::fs::read_to_string(&stat).is_ok_and(|s| !s.contains(") Z ")) {
        anyhow::ensure!(Instant::now() < deadline, "relay-1 outlived kill -9");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its waiting mark ends with its session (waited for, up to 10 s).
    let ended = sqlx::query_scalar!(
        r#"SELECT coalesce(bool_and(pg_terminate_backend(pid, 10000)), true) AS "ended!"
           FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"#,
        holder
    )
    .fetch_one(&pool)
    .await?;
    anyhow::ensure!(ended, "relay-1's session outlived it");
    tx.rollback().await?;
    Ok(())
}

/// The demo run's directory for logs and files.
fn logs_dir(run_id: &str) -> PathBuf {
    std::env::temp_dir().join(format!("jobfold-demo-{run_id}"))
}

pub(crate) fn peak_rss_mib(pid: u32) -> anyhow::Result<f64> {
    status_mib(pid, "VmHWM:")
}

/// A process's resident memory now (VmRSS), in MiB.
pub(crate) fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    status_mib(pid, "VmRSS:")
}

fn status_mib(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("{field} missing from /proc status"))?;
    Ok(kib / 1024.0)
}

/// Waits until `count` jobs are finished.
pub(crate) async fn wait_finished(
    pool: &PgPool,
    count: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let done = sqlx::query_scalar!(
            r#"SELECT count(*) AS "count!" FROM jobs
               WHERE state IN ('succeeded', 'superseded', 'quarantined')"#,
        )
        .fetch_one(pool)
        .await?;
        if done >= count as i64 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "jobs did not finish: {done} of {count}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
