//! The history checker: after a run, what Postgres and the events topic hold must show no
//! lost job and no duplicate effect, whatever happened during the run.
//!
//! - every acknowledged job exists (HTTP and Rust API: by job id; intake: by request id);
//! - every job ended succeeded, quarantined (with a reason), superseded or cancelled: none is
//!   stuck;
//! - exactly one business write per succeeded `index-document` (job, input_version), and none
//!   for a job that did not succeed at that version — counted in `index_writes`, which has no
//!   unique constraint, so a duplicate effect would show; a succeeded job of another kind has
//!   its result stored;
//! - `document_index` holds the highest succeeded input version of every indexed document;
//! - accepted = succeeded + quarantined + superseded + cancelled;
//! - the event log, folded by the schemas crate's fold, from Postgres and from Kafka, gives
//!   exactly the `jobs` projection;
//! - every bad job ended as documented (refused, dead-lettered, quarantined with its reason,
//!   all its versions ended, cancelled while it ran with nothing committed, or scheduled and
//!   not leased before its time), and cost only itself: no well-behaved job took longer from
//!   accept to end, no acknowledged intake request waited longer to be accepted, and the
//!   relay's cursor never stood still longer while events waited, than the run's delay
//!   bound; no event is on the topic more often than the relay's crashes explain.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use crate::bad::{Expect, Ledger};

use jobfold_cli::analytics::{self, Options, Source};
use jobfold_common::config::Config;
use jobfold_schemas::{Decoder, JobEvent};
use sqlx::PgPool;
use uuid::Uuid;

/// What clients were told was accepted.
#[derive(Debug, Default, Clone)]
pub struct Acknowledged {
    /// Job ids answered by the HTTP API or the Rust API.
    pub jobs: Vec<Uuid>,
    /// Intake request ids whose message the broker acknowledged.
    pub requests: Vec<Uuid>,
    /// When each was acknowledged.
    pub request_times: Vec<(Uuid, chrono::DateTime<chrono::Utc>)>,
}

impl Acknowledged {
    /// The broker acknowledged intake request `id` now.
    pub fn acknowledge_request(&mut self, id: Uuid) {
        self.requests.push(id);
        self.request_times.push((id, chrono::Utc::now()));
    }
}

/// What the campaign saw while it ran, for the checker.
#[derive(Debug, Clone, Default)]
pub struct Observed {
    /// Processors that died under the campaign (SIGKILL, a fail point, a bad job's abort),
    /// by pid: a slow bad job running alone in one of them is charged the crash, as
    /// documented (docs/processor.md, "Processes that die").
    pub deaths: std::collections::HashSet<u32>,
    /// When the relay's cursor stood still while events waited.
    pub relay_stalls: Vec<(Utc, Utc)>,
    /// How often one event may be on the topic: 1 + the relay's crash windows hit.
    pub copies_bound: u64,
    /// See [`crate::campaign::Plan::delay_bound`].
    pub delay_bound: Duration,
    /// Every fault injected, and when.
    pub faults: Vec<(Utc, String)>,
    /// See [`crate::campaign::Plan::fault_window`].
    pub fault_window: Duration,
}

type Utc = chrono::DateTime<chrono::Utc>;

/// How much longer than a fault window a quiet stretch lasts at the least: the time it
/// gives outside every window.
pub const QUIET_EXTRA: Duration = Duration::from_secs(10);

/// The quiet stretches between faults a run must hold, so that the delay bound is tested
/// outside the faults' windows more than once ([`Observed::quiet_stretches`]).
pub const QUIET_STRETCHES: usize = 3;

impl Observed {
    /// The stretches between the faults the campaign injected longer than a fault window
    /// plus `extra`: time with no injected fault's window open. Deaths the run brings on
    /// itself (a bad job's abort, a fail point armed before the stretch) still land in them.
    pub fn quiet_stretches(&self, extra: Duration) -> usize {
        let least = chrono::Duration::from_std(self.fault_window + extra).unwrap_or_default();
        let injected = |label: &str| {
            !(label.starts_with("failpoint")
                || label.contains("aborted by a bad job")
                || label.contains("exited by itself"))
        };
        let mut times: Vec<Utc> =
            self.faults.iter().filter(|(_, label)| injected(label)).map(|(at, _)| *at).collect();
        times.sort();
        times.windows(2).filter(|w| w[1] - w[0] >= least).count()
    }

    /// How much of `from..to` lies outside every fault's window (`at..at + fault_window`):
    /// the part of a delay the faults do not explain.
    pub fn unexplained(&self, from: Utc, to: Utc) -> Duration {
        let window = chrono::Duration::from_std(self.fault_window).unwrap_or_default();
        let mut covered = chrono::Duration::zero();
        let mut reach = from;
        let mut landed: Vec<Utc> = self.faults.iter().map(|(at, _)| *at).collect();
        landed.sort();
        for at in landed {
            let (start, end) = (at.max(reach), (at + window).min(to));
            if end > start {
                covered += end - start;
                reach = end;
            }
        }
        (to - from - covered).to_std().unwrap_or_default()
    }
}

/// The checker's verdict and the numbers that go with it.
#[derive(Debug, Default)]
pub struct History {
    /// Every broken guarantee, readable. Empty: the run held.
    pub findings: Vec<String>,
    pub accepted: i64,
    pub states: BTreeMap<String, i64>,
    pub business_writes: i64,
    /// The same event twice on the topic (read back by the Kafka replay).
    pub duplicates_on_topic: u64,
    pub events_in_log: u64,
    /// Per bad job kind: submitted, and ended as documented.
    pub bad: BTreeMap<String, (u64, u64)>,
    /// Well-behaved jobs quarantined because the faults spent their attempts or killed the
    /// processes they ran in ([`check_well_formed`]).
    pub ended_by_deaths: u64,
    /// Well-behaved jobs' accept -> end.
    pub jobs_open: Delays,
    /// Acknowledged intake requests' wait to become a job.
    pub intake_waits: Delays,
    /// The relay cursor's stalls while events waited.
    pub relay_stalls: Delays,
    /// See [`Observed`].
    pub delay_bound: Duration,
    pub fault_window: Duration,
    /// The most copies of one event on the topic, and how many its crashes explain.
    pub most_copies: u64,
    pub copies_bound: u64,
}

/// A set of delays: the 99th percentile, the longest, and the longest part of one that no
/// fault's window explains.
#[derive(Debug, Default, Clone, Copy)]
pub struct Delays {
    pub count: usize,
    pub p99: Duration,
    pub longest: Duration,
    pub unexplained: Duration,
}

impl Delays {
    fn of(spans: &[(Utc, Utc)], observed: &Observed) -> Self {
        let mut took: Vec<Duration> =
            spans.iter().map(|(from, to)| (*to - *from).to_std().unwrap_or_default()).collect();
        took.sort();
        let unexplained = spans
            .iter()
            .map(|(from, to)| observed.unexplained(*from, *to))
            .max()
            .unwrap_or_default();
        Self {
            count: took.len(),
            p99: took.get(took.len() * 99 / 100).copied().unwrap_or_default(),
            longest: took.last().copied().unwrap_or_default(),
            unexplained,
        }
    }
}

impl fmt::Display for Delays {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:>6.1} {:>6.1} {:>6.1} s  ({})",
            self.p99.as_secs_f64(),
            self.longest.as_secs_f64(),
            self.unexplained.as_secs_f64(),
            self.count
        )
    }
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let states: Vec<String> = self.states.iter().map(|(s, n)| format!("{s} {n}")).collect();
        writeln!(f, "jobs accepted {}: {}", self.accepted, states.join(", "))?;
        writeln!(
            f,
            "business writes {}, events in the log {}, duplicates on the topic {}",
            self.business_writes, self.events_in_log, self.duplicates_on_topic
        )?;
        writeln!(
            f,
            "delays (p99 / longest / longest outside the faults' {} s windows, bound {} s):",
            self.fault_window.as_secs(),
            self.delay_bound.as_secs()
        )?;
        writeln!(f, "  well-behaved jobs, accept -> end        {}", self.jobs_open)?;
        writeln!(f, "  intake requests, acknowledged -> job    {}", self.intake_waits)?;
        writeln!(f, "  relay cursor standing while events wait {}", self.relay_stalls)?;
        writeln!(
            f,
            "at most {} copies of an event on the topic ({} explained by the relay's crashes)",
            self.most_copies, self.copies_bound
        )?;
        if self.ended_by_deaths > 0 {
            writeln!(
                f,
                "well-behaved jobs quarantined by the faults (attempts spent, processes killed): {}",
                self.ended_by_deaths
            )?;
        }
        if self.findings.is_empty() {
            writeln!(f, "history: 0 lost, 0 duplicate effects, projection = fold(log)")?;
        }
        for finding in &self.findings {
            writeln!(f, "FINDING: {finding}")?;
        }
        Ok(())
    }
}

async fn ids(pool: &PgPool, sql: &str) -> Vec<String> {
    sqlx::query_scalar::<_, String>(sql)
        .fetch_all(pool)
        .await
        .unwrap_or_else(|e| vec![format!("query failed: {e}")])
}

fn shown(ids: &[String]) -> String {
    let mut text = ids.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
    if ids.len() > 10 {
        text.push_str(&format!(" ... ({} in all)", ids.len()));
    }
    text
}

/// Checks the history of the installation behind `config` and `pool`.
///
/// # Errors
/// The database or the topic cannot be read.
pub async fn check(
    config: &Config,
    pool: &PgPool,
    acknowledged: &Acknowledged,
    ledger: &Ledger,
    observed: &Observed,
) -> anyhow::Result<History> {
    let mut h = History::default();
    let (bad_findings, bad) = check_bad(config, pool, ledger, &observed.deaths).await?;
    h.findings.extend(bad_findings);
    h.bad = bad;
    check_delays(config, pool, acknowledged, observed, &mut h).await?;
    let quiet = observed.quiet_stretches(QUIET_EXTRA);
    if quiet < QUIET_STRETCHES {
        h.findings.push(format!(
            "{quiet} quiet stretches between injected faults (at least {QUIET_STRETCHES} \
             wanted): the delay bound was hardly tested outside the faults' windows"
        ));
    }
    let mut finding = |ok: bool, text: String| {
        if !ok {
            h.findings.push(text);
        }
    };

    // Lost: acknowledged but not in the projection.
    // language=PostgreSQL
    let lost_jobs: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM unnest($1::uuid[]) AS t(id) WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE job_id = id)",
    )
    .bind(&acknowledged.jobs)
    .fetch_all(pool)
    .await?;
    let keys: Vec<String> = acknowledged.requests.iter().map(|r| format!("request:{r}")).collect();
    // language=PostgreSQL
    let lost_requests: Vec<String> = sqlx::query_scalar(
        "SELECT k FROM unnest($1::text[]) AS t(k) WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE idempotency_key = k)",
    )
    .bind(&keys)
    .fetch_all(pool)
    .await?;
    finding(
        lost_jobs.is_empty(),
        format!(
            "{} acknowledged jobs are lost: {:?}",
            lost_jobs.len(),
            &lost_jobs[..lost_jobs.len().min(10)]
        ),
    );
    finding(
        lost_requests.is_empty(),
        format!(
            "{} acknowledged intake requests never became jobs: {}",
            lost_requests.len(),
            shown(&lost_requests)
        ),
    );

    // Stuck, and quarantined without a reason.
    let stuck = ids(
        pool,
        "SELECT job_id::text || ' (' || state || ')' FROM jobs WHERE state NOT IN ('succeeded', 'quarantined', 'superseded', 'cancelled')",
    )
    .await;
    finding(stuck.is_empty(), format!("{} jobs never ended: {}", stuck.len(), shown(&stuck)));
    let reasonless = ids(
        pool,
        "SELECT j.job_id::text FROM jobs j LEFT JOIN quarantine q USING (job_id) \
         WHERE j.state = 'quarantined' AND coalesce(q.reason, '') = ''",
    )
    .await;
    finding(
        reasonless.is_empty(),
        format!("{} quarantined jobs have no reason: {}", reasonless.len(), shown(&reasonless)),
    );

    // Business writes: exactly one per succeeded (job, input_version), none otherwise.
    let doubled = ids(
        pool,
        "SELECT job_id::text || ' v' || input_version || ' x' || count(*) FROM index_writes \
         GROUP BY job_id, input_version HAVING count(*) > 1",
    )
    .await;
    finding(
        doubled.is_empty(),
        format!("{} business writes committed twice: {}", doubled.len(), shown(&doubled)),
    );
    let missing = ids(
        pool,
        "SELECT j.job_id::text FROM jobs j WHERE j.state = 'succeeded' AND j.kind = 'index-document' \
         AND NOT EXISTS \
         (SELECT 1 FROM index_writes w WHERE w.job_id = j.job_id AND w.input_version = j.input_version)",
    )
    .await;
    finding(
        missing.is_empty(),
        format!("{} succeeded jobs have no business write: {}", missing.len(), shown(&missing)),
    );
    // A kind that writes nothing of its own (the HTTP one) has its result stored.
    let no_result = ids(
        pool,
        "SELECT j.job_id::text FROM jobs j WHERE j.state = 'succeeded' AND j.kind <> 'index-document' \
         AND j.result IS NULL",
    )
    .await;
    finding(
        no_result.is_empty(),
        format!("{} succeeded jobs have no result: {}", no_result.len(), shown(&no_result)),
    );
    let stray = ids(
        pool,
        "SELECT w.job_id::text || ' v' || w.input_version FROM index_writes w WHERE NOT EXISTS \
         (SELECT 1 FROM jobs j WHERE j.job_id = w.job_id AND j.state = 'succeeded' AND j.input_version = w.input_version)",
    )
    .await;
    finding(
        stray.is_empty(),
        format!("{} business writes belong to no success: {}", stray.len(), shown(&stray)),
    );

    let (strict, ended_by_deaths) = check_well_formed(pool, &observed.deaths).await;
    h.findings.extend(strict);
    h.ended_by_deaths = ended_by_deaths;
    let mut finding = |ok: bool, text: String| {
        if !ok {
            h.findings.push(text);
        }
    };

    // The index holds each document's highest succeeded version.
    let wrong_index = ids(
        pool,
        "WITH best AS (SELECT document_id, max(input_version) AS v FROM jobs WHERE state = 'succeeded' AND kind = 'index-document' GROUP BY 1) \
         SELECT b.document_id || ': indexed ' || coalesce(d.version::text, 'nothing') || ', best ' || b.v \
         FROM best b LEFT JOIN document_index d USING (document_id) WHERE d.version IS DISTINCT FROM b.v",
    )
    .await;
    finding(
        wrong_index.is_empty(),
        format!(
            "{} documents do not hold their highest succeeded version: {}",
            wrong_index.len(),
            shown(&wrong_index)
        ),
    );

    // accepted = succeeded + quarantined + superseded + cancelled.
    h.states = jobfold_common::gauges::totals(pool).await?.into_iter().collect();
    h.accepted = h.states.values().sum();
    let ended: i64 = ["succeeded", "quarantined", "superseded", "cancelled"]
        .iter()
        .map(|s| h.states.get(*s).copied().unwrap_or(0))
        .sum();
    finding(
        h.accepted == ended,
        format!(
            "accepted {} != succeeded + quarantined + superseded + cancelled {ended}",
            h.accepted
        ),
    );
    // language=PostgreSQL
    h.business_writes =
        sqlx::query_scalar("SELECT count(*) FROM index_writes").fetch_one(pool).await?;

    // fold(log) = projection, from both sources.
    let decoder = Decoder::<JobEvent>::new(jobfold_schemas::codec::registry_settings(
        config.schema_registry_url.expose(),
    )?);
    for source in [Source::Postgres, Source::Kafka] {
        let options = Options { verify: true, ..Options::new(source) };
        let report = analytics::replay(config, pool, &decoder, &options).await?;
        if source == Source::Kafka {
            h.duplicates_on_topic = report.duplicates;
        } else {
            h.events_in_log = report.events;
        }
        let mut problems = report.differences.clone();
        problems.extend(report.anomalies.iter().cloned());
        finding(
            report.is_clean(),
            format!(
                "fold(log from {source:?}) != projection: {} differences, {} anomalies, {} undecodable: {}",
                report.difference_count,
                report.anomaly_count,
                report.undecodable,
                shown(&problems)
            ),
        );
    }
    Ok(h)
}

/// The reason `index-document` quarantines an input with no `text`.
pub const NO_TEXT: &str = "input.text must be a string";

/// What became of the well-behaved submissions (documents `doc-NN`, each submission `n` its
/// own (document, version): `doc-{n % 40}` at version `n / 40 + 1`), beyond lost and stuck:
///
/// - at most one job per submission: a retry of an acknowledged submission (same key, same
///   request id) found the job it made, never made a second;
/// - a job is superseded only when a newer version of its document succeeded;
/// - a well-behaved job is quarantined only for the cause it carried (an input with no
///   `text`, [`NO_TEXT`]) or for its attempts spent: its own failures are fewer than its
///   attempts, so only the faults (leases lapsing under a stopped process, the deaths of
///   the processes it ran in) can have spent them, and a death its reason names must be
///   one the campaign caused (`deaths`); those are counted, not findings. Any other reason
///   (a permanent failure, a time-out, a panic) is a cause it did not carry.
///
/// Returns the findings and the count of well-formed jobs ended by the deaths of their
/// processes.
pub async fn check_well_formed(
    pool: &PgPool,
    deaths: &std::collections::HashSet<u32>,
) -> (Vec<String>, u64) {
    let mut findings = Vec::new();
    let twice = ids(
        pool,
        "SELECT document_id || ' v' || input_version || ': ' || count(*) || ' jobs' FROM jobs \
         WHERE document_id LIKE 'doc-%' GROUP BY document_id, input_version HAVING count(*) > 1",
    )
    .await;
    if !twice.is_empty() {
        findings.push(format!(
            "{} submissions made more than one job: {}",
            twice.len(),
            shown(&twice)
        ));
    }
    let unfounded = ids(
        pool,
        "SELECT j.job_id::text || ' (' || j.document_id || ' v' || j.input_version || ')' \
         FROM jobs j WHERE j.state = 'superseded' AND NOT EXISTS (SELECT 1 FROM jobs k \
         WHERE k.document_id = j.document_id AND k.kind = j.kind \
         AND k.input_version > j.input_version AND k.state = 'succeeded')",
    )
    .await;
    if !unfounded.is_empty() {
        findings.push(format!(
            "{} jobs superseded with no newer version of their document succeeded: {}",
            unfounded.len(),
            shown(&unfounded)
        ));
    }
    // language=PostgreSQL
    let quarantined: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT j.job_id, coalesce(q.reason, '') FROM jobs j JOIN quarantine q USING (job_id) \
         WHERE j.state = 'quarantined' AND j.document_id LIKE 'doc-%'",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let mut ended_by_deaths = 0;
    let mut uncaused = Vec::new();
    for (job_id, reason) in quarantined {
        // The one cause a well-behaved submission carries: an input with no `text`.
        if reason.contains(NO_TEXT) {
            continue;
        }
        if by_faults(&reason, deaths) {
            ended_by_deaths += 1;
        } else {
            uncaused.push(format!("{job_id}: {reason}"));
        }
    }
    if !uncaused.is_empty() {
        findings.push(format!(
            "{} well-formed jobs quarantined for a cause they did not carry: {}",
            uncaused.len(),
            shown(&uncaused)
        ));
    }
    (findings, ended_by_deaths)
}

/// The tally's line for bad jobs (of kinds that do not crash) ended by processes that died
/// under them.
pub const BYSTANDERS: &str = "(counted above) ended by processes killed under them";

/// The pid of the process a crash reason names: "the process running it (host/pid) died".
/// Whether a quarantine `reason` is the faults' doing: its attempts spent, or its processes
/// killed `max_crashes` times, so long as a death it names is one the campaign caused.
fn by_faults(reason: &str, deaths: &std::collections::HashSet<u32>) -> bool {
    let spent =
        reason.starts_with("attempt budget spent") || reason.contains("killed its processor");
    let death_known = match crash_pid(reason) {
        Some(pid) => deaths.contains(&pid),
        None => !reason.contains("killed its processor"),
    };
    spent && death_known
}

fn crash_pid(reason: &str) -> Option<u32> {
    let (_, rest) = reason.split_once("the process running it (")?;
    let (owner, _) = rest.split_once(')')?;
    owner.rsplit('/').next()?.parse().ok()
}

/// Each bad job ended as documented; per kind, how many were submitted and ended so.
async fn check_bad(
    config: &Config,
    pool: &PgPool,
    ledger: &Ledger,
    deaths: &std::collections::HashSet<u32>,
) -> anyhow::Result<(Vec<String>, BTreeMap<String, (u64, u64)>)> {
    let mut findings = ledger.unanswered.clone();
    if ledger.redirects_followed > 0 {
        findings.push(format!(
            "a redirect was followed: the URL it named was called {} times",
            ledger.redirects_followed
        ));
    }
    let mut tally: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for bad in &ledger.bad {
        // language=PostgreSQL
        let jobs: Vec<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT j.state::text, j.input_version, q.reason FROM jobs j \
             LEFT JOIN quarantine q USING (job_id) WHERE j.document_id = $1 ORDER BY j.input_version",
        )
        .bind(&bad.document)
        .fetch_all(pool)
        .await?;
        // language=PostgreSQL
        let dead_letters: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM dead_letters WHERE consumer_group = $1 AND raw_key = $2",
        )
        .bind(&config.intake.group)
        .bind(bad.document.as_bytes())
        .fetch_one(pool)
        .await?;
        // A job ended by the deaths of the processes it ran in, each one the campaign's doing
        // (so `max_crashes` of them in a row while it ran alone, or its attempts spent with
        // the last one lost with its process): documented for any job, not only the one
        // that aborts its process.
        let died_under_it = match jobs.as_slice() {
            [(state, 1, Some(reason))] if state == "quarantined" => {
                (reason.contains("killed its processor")
                    || (reason.starts_with("attempt budget spent")
                        && reason.contains("died before its attempt committed")))
                    && crash_pid(reason).is_some_and(|pid| deaths.contains(&pid))
            }
            _ => false,
        };
        if died_under_it && bad.kind != crate::bad::BadKind::Aborts {
            let entry = tally.entry(BYSTANDERS.to_owned()).or_default();
            entry.0 += 1;
            entry.1 += 1;
        }
        let ended = died_under_it
            || match &bad.expect {
                Expect::Refused => jobs.is_empty() && bad.job_id.is_none(),
                Expect::DeadLettered => jobs.is_empty() && dead_letters >= 1,
                Expect::Quarantined(why) => match jobs.as_slice() {
                    // Or by the lease transaction, when every attempt died with its process.
                    [(state, 1, Some(reason))] if state == "quarantined" => {
                        reason.contains(why) || reason.starts_with("attempt budget spent:")
                    }
                    // A replay whose answer was lost with its connection, committed.
                    [(state, 2, None)] if state == "succeeded" && *why == "permanent failure" => {
                        true
                    }
                    _ => false,
                },
                Expect::Replayed { version } => {
                    matches!(jobs.as_slice(), [(state, v, None)] if state == "succeeded" && v == version)
                }
                Expect::Cancelled | Expect::CancelUnanswered | Expect::EndedBeforeCancel => {
                    let (cancelled, other) = match jobs.as_slice() {
                        [(state, 1, _)] => (state == "cancelled", state != "cancelled"),
                        _ => (false, false),
                    };
                    // Nothing committed for a cancelled job: no result, no business write.
                    // language=PostgreSQL
                    let committed: i64 = sqlx::query_scalar(
                        "SELECT (SELECT count(*) FROM jobs WHERE job_id = $1 AND result IS NOT NULL) \
                          + (SELECT count(*) FROM index_writes WHERE job_id = $1)",
                    )
                    .bind(bad.job_id)
                    .fetch_one(pool)
                    .await?;
                    match bad.expect {
                        Expect::Cancelled => cancelled && committed == 0,
                        Expect::EndedBeforeCancel => other,
                        _ => (cancelled && committed == 0) || other,
                    }
                }
                Expect::RanAt(run_at) => {
                    let first_lease = crate::harness::logged_leases(pool, bad.job_id)
                        .await
                        .first()
                        .map(|lease| lease.leased_at);
                    matches!(jobs.as_slice(), [(state, 1, None)] if state == "succeeded")
                        && first_lease.is_some_and(|t| t >= *run_at)
                }
                Expect::Succeeded => {
                    matches!(jobs.as_slice(), [(state, 1, None)] if state == "succeeded")
                }
                Expect::AllEnded { versions } => {
                    // language=PostgreSQL
                    let indexed: Option<i64> = sqlx::query_scalar(
                        "SELECT version FROM document_index WHERE document_id = $1",
                    )
                    .bind(&bad.document)
                    .fetch_optional(pool)
                    .await?;
                    // Each version ended; one the faults quarantined (its attempts spent by
                    // the processes killed under it) counts as any well-behaved job's does.
                    jobs.len() as i64 == *versions
                        && jobs.iter().all(|(s, _, reason)| {
                            s == "succeeded"
                                || s == "superseded"
                                || (s == "quarantined"
                                    && reason.as_deref().is_some_and(|r| by_faults(r, deaths)))
                        })
                        && indexed == Some(*versions)
                }
            };
        let entry = tally.entry(bad.kind.name().to_owned()).or_default();
        entry.0 += 1;
        if ended {
            entry.1 += 1;
        } else {
            let summary: Vec<String> =
                jobs.iter().take(3).map(|(s, v, r)| format!("v{v} {s} {r:?}")).collect();
            findings.push(format!(
                "bad job {} ({}) did not end as documented ({:?}): {} jobs [{}], {dead_letters} dead letters",
                bad.document,
                bad.kind.name(),
                bad.expect,
                jobs.len(),
                summary.join("; ")
            ));
        }
    }
    Ok((findings, tally))
}

/// What the bad jobs cost the others: well-behaved jobs' accept -> end, intake waits and the
/// relay's stalls, each outside the faults' windows against the delay bound, and the copies
/// of events on the topic against the relay's crashes.
async fn check_delays(
    config: &Config,
    pool: &PgPool,
    acknowledged: &Acknowledged,
    observed: &Observed,
    h: &mut History,
) -> anyhow::Result<()> {
    let bound = observed.delay_bound;
    h.delay_bound = bound;
    h.fault_window = observed.fault_window;
    let now = chrono::Utc::now();
    // A job still open counts until now.
    // language=PostgreSQL
    let open: Vec<(Uuid, Utc, Option<Utc>)> = sqlx::query_as(
        r#"
        SELECT job_id, accepted_at, finished_at FROM jobs
        WHERE document_id NOT LIKE 'bad-%' AND document_id NOT LIKE 'hot-%'
        "#,
    )
    .fetch_all(pool)
    .await?;
    let spans: Vec<(Utc, Utc)> =
        open.iter().map(|(_, from, to)| (*from, to.unwrap_or(now))).collect();
    h.jobs_open = Delays::of(&spans, observed);
    if h.jobs_open.unexplained > bound {
        let mut slow: Vec<(Duration, Uuid)> = open
            .iter()
            .map(|(id, from, to)| (observed.unexplained(*from, to.unwrap_or(now)), *id))
            .filter(|(d, _)| *d > bound)
            .collect();
        slow.sort_by(|a, b| b.cmp(a));
        let ids: Vec<Uuid> = slow.iter().take(5).map(|(_, id)| *id).collect();
        h.findings.push(format!(
            "{} well-behaved jobs were open longer than the bound of {} s outside the faults' \
             windows, {:.1} s at most; the slowest:\n{}",
            slow.len(),
            bound.as_secs(),
            h.jobs_open.unexplained.as_secs_f64(),
            accounts(pool, &ids, observed).await?
        ));
    }

    let (ids, sent): (Vec<String>, Vec<Utc>) =
        acknowledged.request_times.iter().map(|(id, at)| (format!("request:{id}"), *at)).unzip();
    // A request with no job waits until now.
    // language=PostgreSQL
    let waits: Vec<(Utc, Option<Utc>)> = sqlx::query_as(
        r#"
        SELECT r.sent, j.accepted_at
        FROM unnest($1::text[], $2::timestamptz[]) AS r(key, sent)
        LEFT JOIN jobs j ON j.idempotency_key = r.key
        "#,
    )
    .bind(&ids)
    .bind(&sent)
    .fetch_all(pool)
    .await?;
    let spans: Vec<(Utc, Utc)> =
        waits.iter().map(|(sent, accepted)| (*sent, accepted.unwrap_or(now).max(*sent))).collect();
    h.intake_waits = Delays::of(&spans, observed);
    if h.intake_waits.unexplained > bound {
        h.findings.push(format!(
            "an acknowledged intake request waited {:.1} s to be accepted outside the faults' \
             windows, over the bound of {} s",
            h.intake_waits.unexplained.as_secs_f64(),
            bound.as_secs()
        ));
    }

    h.relay_stalls = Delays::of(&observed.relay_stalls, observed);
    if h.relay_stalls.unexplained > bound {
        h.findings.push(format!(
            "the relay's cursor stood still {:.1} s while events waited, outside the faults' \
             windows, over the bound of {} s",
            h.relay_stalls.unexplained.as_secs_f64(),
            bound.as_secs()
        ));
    }
    h.copies_bound = observed.copies_bound;
    h.most_copies = most_copies(config)?;
    if h.most_copies > h.copies_bound {
        h.findings.push(format!(
            "an event is on the topic {} times; the relay's crashes explain at most {}",
            h.most_copies, h.copies_bound
        ));
    }
    Ok(())
}

/// Jobs `ids`, each with its events and the faults that landed while it was open, as seconds
/// since its accept.
async fn accounts(pool: &PgPool, ids: &[Uuid], observed: &Observed) -> anyhow::Result<String> {
    let mut out = String::new();
    for id in ids {
        // language=PostgreSQL
        let (document, version, accepted, finished, error, crashes): (
            String,
            i64,
            Utc,
            Option<Utc>,
            Option<String>,
            Option<i32>,
        ) = sqlx::query_as(
            "SELECT document_id, input_version, accepted_at, finished_at, last_error, c.crashes \
             FROM jobs LEFT JOIN job_counters c USING (job_id) WHERE job_id = $1",
        )
        .bind(id)
        .fetch_one(pool)
        .await?;
        let finished = finished.unwrap_or_else(chrono::Utc::now);
        let at = |t: Utc| (t - accepted).as_seconds_f64();
        // language=PostgreSQL
        let events: Vec<(String, Utc)> = sqlx::query_as(
            "SELECT kind, occurred_at FROM job_events WHERE job_id = $1 ORDER BY stream_version",
        )
        .bind(id)
        .fetch_all(pool)
        .await?;
        let events: Vec<String> =
            events.iter().map(|(kind, t)| format!("{kind} {:+.1}", at(*t))).collect();
        let window = chrono::Duration::from_std(observed.fault_window).unwrap_or_default();
        let landed: Vec<String> = observed
            .faults
            .iter()
            .filter(|(t, _)| *t + window >= accepted && *t <= finished)
            .map(|(t, kind)| format!("{kind} {:+.1}", at(*t)))
            .collect();
        let error: String = error.unwrap_or_default().chars().take(200).collect();
        out.push_str(&format!(
            "  {document} v{version} ({id}), {:.1} s: {}\n    last error: {}; crashes: {}\n    faults: {}\n",
            at(finished),
            events.join(", "),
            if error.is_empty() { "none" } else { &error },
            crashes.unwrap_or(0),
            if landed.is_empty() { "none".to_owned() } else { landed.join(", ") }
        ));
    }
    Ok(out)
}

/// The most copies of one message (same key and bytes) on the events topic.
fn most_copies(config: &Config) -> anyhow::Result<u64> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let consumer: BaseConsumer = config
        .kafka_client_for(
            jobfold_common::config::KafkaRole::Consumer,
            jobfold_common::kafka::CONSUMER_DEFAULTS,
        )
        .set("group.id", format!("campaign-copies-{}", Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .create()?;
    let topic = &config.topics.events;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .first()
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    let mut assignment = rdkafka::TopicPartitionList::new();
    let mut ends = HashMap::new();
    for p in &partitions {
        let (low, high) = consumer.fetch_watermarks(topic, *p, Duration::from_secs(10))?;
        if high > low {
            assignment.add_partition_offset(topic, *p, rdkafka::Offset::Offset(low))?;
            ends.insert(*p, high);
        }
    }
    consumer.assign(&assignment)?;
    let mut copies: HashMap<u64, u64> = HashMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !ends.is_empty() && std::time::Instant::now() < deadline {
        let Some(message) = consumer.poll(Duration::from_secs(1)) else { continue };
        let message = message?;
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        message.key().hash(&mut hasher);
        message.payload().hash(&mut hasher);
        *copies.entry(hasher.finish()).or_default() += 1;
        if ends.get(&message.partition()).is_some_and(|end| message.offset() + 1 >= *end) {
            ends.remove(&message.partition());
        }
    }
    anyhow::ensure!(ends.is_empty(), "the events topic could not be read to its end");
    Ok(copies.values().copied().max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Utc {
        chrono::DateTime::from_timestamp(1_800_000_000 + secs, 0).expect("a time")
    }

    fn observed(faults: &[i64]) -> Observed {
        Observed {
            faults: faults.iter().map(|s| (at(*s), "fault".to_owned())).collect(),
            fault_window: Duration::from_secs(10),
            ..Observed::default()
        }
    }

    #[test]
    fn only_what_no_fault_window_covers_is_unexplained() {
        // No fault: all of it.
        assert_eq!(observed(&[]).unexplained(at(0), at(30)), Duration::from_secs(30));
        // One window inside: 30 - 10.
        assert_eq!(observed(&[5]).unexplained(at(0), at(30)), Duration::from_secs(20));
        // Overlapping windows count once (5..20), in any order.
        assert_eq!(observed(&[10, 5]).unexplained(at(0), at(30)), Duration::from_secs(15));
        // A window opened before the span covers its start; one after it, nothing.
        assert_eq!(observed(&[-5, 40]).unexplained(at(0), at(30)), Duration::from_secs(25));
        // Covered end to end.
        assert_eq!(observed(&[0, 9, 18, 27]).unexplained(at(0), at(30)), Duration::ZERO);
    }

    #[test]
    fn delays_report_the_worst_unexplained_part() {
        let spans = [(at(0), at(30)), (at(40), at(45)), (at(50), at(52))];
        let delays = Delays::of(&spans, &observed(&[0]));
        assert_eq!(delays.count, 3);
        assert_eq!(delays.longest, Duration::from_secs(30));
        // The 30 s span has 10 s covered; the 5 s one none.
        assert_eq!(delays.unexplained, Duration::from_secs(20));
    }
}
