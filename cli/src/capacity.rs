//! `jobfold capacity`: the figures a capacity decision needs, read from the job event log
//! (Kafka or Postgres) over a window, per kind.
//!
//! - **arrivals**: `JobRequested` events (a scheduled job arrives at its `run_at`), per second;
//! - **service time**: how long an attempt held its worker slot, from the lease's own start
//!   (`JobLeased.leased_at`, or `JobSucceeded.lease.leased_at` for a run that ended inside its
//!   lease transaction: such a run starts before its event is stamped at the transaction's
//!   end; for events without it, `lease_until` less the kind's `lease_ttl` as configured
//!   here) to its `JobSucceeded` or
//!   `JobFailed` (or the `JobSuperseded` that ended it);
//! - **retry share**: attempts that failed, of all attempts that ended;
//! - **in service**: on average by Little's law (attempts a second × mean service time), and
//!   at the peak (the most attempts between start and end at one instant);
//! - **queue wait**: from when a job could run (its arrival, its retry's due time, a replay)
//!   to its lease's start;
//! - **dispatch latency**: the waits of the attempts that found a free worker (fewer in
//!   service than the window's concurrency when they became ready), as a distribution.
//!
//! The window counts a dispatch whose ready time falls in it: an arrival before `until`
//! leased after it is followed to its lease and end; a lease whose job became ready before
//! `since` holds a worker in the simulation but has no wait of its own to count.
//!
//! Given a waiting-time objective (`--wait 2s`, at `--quantile 0.99`), it finds the least
//! concurrency meeting it **by simulation, driven by the log itself**: the window's
//! dispatches, each entering a FIFO queue with that many servers at its ready time plus a
//! dispatch latency (its own if it found a free worker, else one of those measured, in
//! turn), with their own service times. No distribution is assumed. It never answers less
//! than the mean in service plus one: below that the queue grows without end, and a finite
//! window could hide it. The answer is for the group as a whole (the sum over its
//! processors of the kind's `concurrency`, or of `processor.max_in_flight`).
//!
//! Memory: a few dozen bytes per attempt in the window, and the jobs still open.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

use anyhow::Context;
use chrono::{DateTime, Utc};
use jobfold_common::config::Config;
use jobfold_schemas::{Decoder, JobEvent, Payload};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::analytics::{Reader, Source};

/// What to read, and what to answer.
#[derive(Debug, Clone)]
pub struct Options {
    pub source: Source,
    /// The window: events at or after `since`, and not after `until` (else to the end of
    /// the log). An attempt leased in the window is followed past `until` to its end.
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// The waiting-time objective: `quantile` of queue waits at most `wait`.
    pub objective: Option<Objective>,
}

/// A waiting-time objective.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Objective {
    /// Seconds.
    pub wait: f64,
    pub quantile: f64,
    /// The share by which service times are lengthened for the answer (0.1: 10%), so that
    /// it holds on a day a little busier or slower than the window.
    pub headroom: f64,
}

/// One attempt: when it could have run, when it started, when it ended.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    /// When it could have run; `None` when that was before the window (its wait unknown).
    ready: Option<f64>,
    started: f64,
    ended: f64,
    failed: bool,
}

/// A job being read: its next dispatch's ready time, its open lease (generation, ready,
/// start).
#[derive(Debug, Default)]
struct Open {
    last_version: i32,
    ready: Option<f64>,
    lease: Option<(i64, Option<f64>, f64)>,
}

/// What one kind did in the window.
#[derive(Debug, Default)]
struct Kind {
    arrivals: Vec<f64>,
    attempts: Vec<Attempt>,
    /// The processors that leased its jobs (`lease_owner`).
    owners: HashSet<String>,
}

/// Quantiles of a sample, in seconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        Self {
            count: values.len(),
            mean,
            p50: quantile(&values, 0.50),
            p90: quantile(&values, 0.90),
            p99: quantile(&values, 0.99),
            max: values[values.len() - 1],
        }
    }
}

/// The `q` quantile of sorted `values` (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The figures of one kind.
#[derive(Debug, Clone, Serialize)]
pub struct KindReport {
    pub kind: String,
    pub arrivals: usize,
    /// Jobs a second.
    pub arrival_rate: f64,
    pub attempts: usize,
    pub service_seconds: Spread,
    pub retry_share: f64,
    /// Little's law: attempts a second × mean service time.
    pub in_service_mean: f64,
    pub in_service_peak: usize,
    /// Waits of the attempts whose ready time is in the window.
    pub wait_seconds: Spread,
    /// What a dispatch takes when a worker is free: the waits of the attempts that found
    /// fewer in service than `window_concurrency` when they became ready.
    pub dispatch_latency_seconds: Spread,
    /// How long a worker freed by an attempt's end took to start the next queued one (the
    /// completion's commit, the next lease): measured from the attempts that queued, none
    /// when nothing did. The simulation holds every worker this much (the mean) past each
    /// service time.
    pub handoff_seconds: Spread,
    /// The processors that leased the kind's jobs in the window.
    pub processors: usize,
    /// The concurrency the window could run at once: the configured concurrency times the
    /// processors, or the peak in service if more ran than that (the processors configured
    /// otherwise than here).
    pub window_concurrency: usize,
    /// Mean in service over `window_concurrency`: how busy the workers were.
    pub window_utilization: f64,
    /// The objective's quantile (else the 99th percentile) of `wait_seconds`.
    pub measured_wait_seconds: f64,
    /// The simulation at `window_concurrency` with no headroom: the objective's quantile
    /// wait it predicts for the window itself, to set against `wait_seconds`.
    pub simulated_window_wait_seconds: Option<f64>,
    /// For the objective: the least concurrency meeting it in the simulation, and the wait
    /// quantile simulated there (dispatch latency included).
    pub recommended_concurrency: Option<usize>,
    pub simulated_wait_seconds: Option<f64>,
    /// Jobs in service on average over the recommended concurrency: below 1.
    pub utilization: Option<f64>,
    /// The simulated wait quantile (with the headroom) at each concurrency from the stable
    /// floor to past the recommendation and the window's concurrency.
    pub wait_by_concurrency: Vec<CurvePoint>,
    /// Why there is no recommendation for the objective, when none meets it.
    pub unreachable: Option<String>,
    /// What one processor is configured with: the kind's `concurrency`, else
    /// `processor.max_in_flight`.
    pub configured_concurrency: usize,
    pub configured_from: &'static str,
}

/// One point of the wait-versus-workers curve.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct CurvePoint {
    pub concurrency: usize,
    pub wait_seconds: f64,
}

/// The whole answer.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub source: &'static str,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub window_seconds: f64,
    pub objective: Option<Objective>,
    pub method: &'static str,
    pub kinds: Vec<KindReport>,
    /// Per kind, the figures over time, for the plot.
    #[serde(skip)]
    series: BTreeMap<String, Series>,
}

/// A kind's figures in equal buckets of the window, and its waits' quantile over spans of
/// buckets holding at least `min_jobs` attempts each.
#[derive(Debug, Clone, Default)]
struct Series {
    bucket_seconds: f64,
    arrivals_per_second: Vec<f64>,
    in_service: Vec<f64>,
    quantile: f64,
    min_jobs: usize,
    /// (from, to, the quantile wait of the attempts that started in between)
    waits: Vec<(f64, f64, f64)>,
}

/// Buckets the plot divides the window into.
const BUCKETS: usize = 120;

/// The fewest attempts a plotted wait quantile `q` is taken over: enough that a few lie
/// beyond it (300 for p99), so that it is not the span's maximum; never fewer than 50.
fn min_jobs(q: f64) -> usize {
    ((3.0 / (1.0 - q).max(1e-6)).ceil() as usize).clamp(50, 100_000)
}

/// Reads the log over the window and works out the figures.
///
/// # Errors
/// The source could not be read.
pub async fn measure(
    config: &Config,
    pool: &PgPool,
    decoder: &Decoder<JobEvent>,
    options: &Options,
) -> anyhow::Result<Report> {
    let (mut reader, _) = Reader::open(config, pool, options.source, options.since).await?;
    // Times are seconds from `anchor`: the window's start if given, else the first event
    // read (Kafka's partitions interleave, so not always the earliest: `first` is).
    let mut anchor: Option<DateTime<Utc>> = options.since;
    let (mut first, mut last) = (f64::MAX, f64::MIN);
    let mut open: HashMap<Uuid, Open> = HashMap::new();
    let mut ended: HashSet<Uuid> = HashSet::new();
    let mut kinds: BTreeMap<String, Kind> = BTreeMap::new();
    // Each kind's lease TTL in seconds, as configured here: the start of a lease whose event
    // does not say it is its `lease_until` less this.
    let ttl = |kind: &str| config.kind(kind).lease_ttl.as_secs_f64();
    while let Some(batch) = reader.next().await? {
        for (_, frame) in batch {
            let Ok(event) = decoder.decode(&frame).await else { continue };
            // Past the window's end, only the leases and ends of dispatches ready within it
            // count.
            let after = options.until.is_some_and(|until| event.occurred_at > until);
            if after
                && !matches!(
                    event.payload,
                    Payload::JobLeased(_)
                        | Payload::JobSucceeded(_)
                        | Payload::JobFailed(_)
                        | Payload::JobSuperseded(_)
                        | Payload::JobCancelled(_)
                )
            {
                continue;
            }
            let origin = *anchor.get_or_insert(event.occurred_at);
            let at = seconds(event.occurred_at, origin);
            let until = options.until.map(|until| seconds(until, origin));
            if !after {
                first = first.min(at);
                last = last.max(at);
            }
            if ended.contains(&event.job_id) {
                continue;
            }
            if after && !open.contains_key(&event.job_id) {
                continue;
            }
            let job = open.entry(event.job_id).or_default();
            // A duplicate (Kafka after a relay crash) or an older event read late.
            if event.stream_version <= job.last_version {
                continue;
            }
            job.last_version = event.stream_version;
            let kind = kinds.entry(event.job_kind.clone()).or_default();
            let mut end_attempt = |job: &mut Open, generation: i64, failed: bool| {
                if let Some((leased_generation, ready, started)) = job.lease
                    && leased_generation == generation
                {
                    kind.attempts.push(Attempt { ready, started, ended: at, failed });
                    job.lease = None;
                }
            };
            let mut finished = false;
            match &event.payload {
                Payload::JobRequested(requested) => {
                    let ready = requested.run_at.map_or(at, |r| seconds(r, origin).max(at));
                    // A job scheduled past the window arrives after it.
                    if until.is_none_or(|until| ready <= until) {
                        kind.arrivals.push(ready);
                    }
                    job.ready = Some(ready);
                }
                Payload::RetryDue(due) => {
                    job.ready = Some(seconds(due.due_at, origin).max(at));
                }
                Payload::ReplayRequested(_) => job.ready = Some(at),
                Payload::JobLeased(leased) => {
                    let ready = job.ready.take().map(|ready| ready.min(at));
                    // Leased after the window for a dispatch that became ready after it too.
                    if after && !ready.zip(until).is_some_and(|(ready, until)| ready <= until) {
                        continue;
                    }
                    // The lease's own start: in the event, or (written before it was) its
                    // `lease_until` less the TTL configured here.
                    let began = leased.leased_at.map_or_else(
                        || seconds(leased.lease_until, origin) - ttl(&event.job_kind),
                        |leased_at| seconds(leased_at, origin),
                    );
                    let started = lease_start(began, ready, at);
                    kind.owners.insert(leased.lease_owner.clone());
                    job.lease = Some((leased.generation, ready, started));
                }
                Payload::JobSucceeded(s) => {
                    // A success that took its own lease (its run ended inside its lease
                    // transaction) starts its attempt too, at the lease's own start.
                    // Past the window, only for a dispatch that became ready within it.
                    if let Some(lease) = &s.lease {
                        let ready = job.ready.take().map(|ready| ready.min(at));
                        if !after || ready.zip(until).is_some_and(|(ready, until)| ready <= until) {
                            let started = lease_start(seconds(lease.leased_at, origin), ready, at);
                            kind.owners.insert(lease.lease_owner.clone());
                            job.lease = Some((s.generation, ready, started));
                        }
                    }
                    end_attempt(job, s.generation, false);
                    finished = true;
                }
                Payload::JobFailed(f) => end_attempt(job, f.generation, true),
                Payload::JobSuperseded(_) | Payload::JobCancelled(_) => {
                    if let Some((generation, ..)) = job.lease {
                        end_attempt(job, generation, false);
                    }
                    finished = true;
                }
                Payload::JobQuarantined(_) | Payload::JobRetryScheduled(_) => {}
            }
            if finished {
                open.remove(&event.job_id);
                ended.insert(event.job_id);
            }
        }
    }
    let anchor = anchor.unwrap_or_else(Utc::now);
    // Without a given start, the window starts at the earliest event.
    let start = if options.since.is_some() || first == f64::MAX { 0.0 } else { first };
    for kind in kinds.values_mut() {
        kind.arrivals.iter_mut().for_each(|t| *t -= start);
        for a in &mut kind.attempts {
            a.ready = a.ready.map(|ready| ready - start);
            (a.started, a.ended) = (a.started - start, a.ended - start);
        }
    }
    let origin = anchor + chrono::Duration::microseconds((start * 1e6) as i64);
    let last = if last == f64::MIN { 0.0 } else { last - start };
    let end = options.until.map_or(last, |until| seconds(until, origin).max(last));
    let window = end.max(1e-3);
    let mut report = Report {
        source: match options.source {
            Source::Kafka => "kafka",
            Source::Postgres => "postgres",
        },
        window_start: origin,
        window_end: origin + chrono::Duration::milliseconds((window * 1000.0) as i64),
        window_seconds: window,
        objective: options.objective,
        method: "trace-driven simulation: the window's own dispatches enter a FIFO queue \
                 of c servers at their ready times plus a measured dispatch latency, with \
                 their own service times lengthened by the headroom; c above the mean in \
                 service (with the headroom), below which the queue grows without end",
        kinds: Vec::new(),
        series: BTreeMap::new(),
    };
    for (name, kind) in kinds {
        if kind.arrivals.is_empty() && kind.attempts.is_empty() {
            continue;
        }
        let settings = config.kind(&name);
        let (configured_concurrency, configured_from) = match settings.concurrency {
            Some(c) => (c, "kind concurrency"),
            None => (config.processor.max_in_flight, "processor.max_in_flight"),
        };
        let (figures, series) =
            figures(&name, &kind, window, options.objective, configured_concurrency);
        report.kinds.push(KindReport { configured_from, ..figures });
        report.series.insert(name, series);
    }
    Ok(report)
}

fn seconds(at: DateTime<Utc>, origin: DateTime<Utc>) -> f64 {
    (at - origin).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6
}

/// When an attempt leased at `leased` (its event's time) started: its lease's start
/// `began`, which precedes the event for a run inside its lease transaction — never before
/// the job was ready, nor after the event (clocks apart, a TTL configured otherwise).
fn lease_start(began: f64, ready: Option<f64>, leased: f64) -> f64 {
    let earliest = ready.unwrap_or(f64::MIN).min(leased);
    began.clamp(earliest, leased)
}

/// One customer of the simulation: when its job was ready, when it joins the queue (ready
/// plus a dispatch latency), how long it holds a server, and whether its wait counts (its
/// ready time is in the window).
#[derive(Debug, Clone, Copy)]
struct Customer {
    ready: f64,
    enters: f64,
    service: f64,
    counted: bool,
}

/// One kind's figures over a window of `window` seconds; `configured` is one processor's
/// concurrency for it.
fn figures(
    name: &str,
    kind: &Kind,
    window: f64,
    objective: Option<Objective>,
    configured: usize,
) -> (KindReport, Series) {
    let service: Vec<f64> = kind.attempts.iter().map(|a| a.ended - a.started).collect();
    let waits: Vec<f64> =
        kind.attempts.iter().filter_map(|a| a.ready.map(|ready| a.started - ready)).collect();
    let service_seconds = Spread::of(service);
    let quantile_of = objective.map_or(0.99, |o| o.quantile);
    let measured_wait = {
        let mut sorted = waits.clone();
        sorted.sort_by(f64::total_cmp);
        quantile(&sorted, quantile_of)
    };
    let wait_seconds = Spread::of(waits);
    let failed = kind.attempts.iter().filter(|a| a.failed).count();
    let attempts = kind.attempts.len();
    // The most attempts in service at once: +1 at each start, -1 at each end.
    let mut edges: Vec<(f64, i64)> =
        kind.attempts.iter().flat_map(|a| [(a.started, 1), (a.ended, -1)]).collect();
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, step) in edges {
        now += step;
        peak = peak.max(now);
    }
    let peak = usize::try_from(peak).unwrap_or(0);
    let processors = kind.owners.len().max(1);
    // What the window could run at once: as configured here, unless more ran (a different
    // configuration where the processors run).
    let window_concurrency = configured.saturating_mul(processors).max(peak).max(1);
    let in_service_mean = attempts as f64 / window * service_seconds.mean;
    let (latency, handoffs, customers) = customers(&kind.attempts, window_concurrency);
    // A worker is held a little past each attempt's end and before the next one's start
    // (the completion's commit, the next lease): what a queued attempt waited past the end
    // that freed its worker. Every attempt holds its worker that much longer.
    let handoff = Spread::of(handoffs);
    let customers: Vec<Customer> = customers
        .into_iter()
        .map(|c| Customer { service: c.service + handoff.mean, ..c })
        .collect();
    let simulated_window = (attempts > 0)
        .then(|| simulate(&lengthened(&customers, 0.0), window_concurrency, quantile_of));
    let (mut recommended, mut simulated, mut curve) = (None, None, Vec::new());
    let mut unreachable = None;
    if let Some(objective) = objective
        && attempts > 0
    {
        // Below the mean in service the queue grows without end: a finite window could
        // still show waits within the objective, so the search starts above it.
        let held = attempts as f64 / window * (service_seconds.mean + handoff.mean);
        let stable = (held * (1.0 + objective.headroom)).floor() as usize + 1;
        let customers = lengthened(&customers, objective.headroom);
        match recommend(&customers, objective, stable) {
            Ok((c, wait)) => {
                (recommended, simulated) = (Some(c), Some(wait));
                let near = c.max(window_concurrency.min(peak));
                curve = wait_curve(&customers, objective.quantile, stable, near);
            }
            Err(wait) => {
                unreachable = Some(format!(
                    "no concurrency meets the objective: with a worker for every attempt the \
                     simulated {} wait is {wait:.3} s, what the dispatch latency alone adds",
                    percentile_name(objective.quantile)
                ));
            }
        }
    }
    let report = KindReport {
        kind: name.to_owned(),
        arrivals: kind.arrivals.len(),
        arrival_rate: kind.arrivals.len() as f64 / window,
        attempts,
        retry_share: if attempts == 0 { 0.0 } else { failed as f64 / attempts as f64 },
        in_service_mean,
        utilization: recommended.map(|c| in_service_mean / c as f64),
        in_service_peak: peak,
        service_seconds,
        wait_seconds,
        measured_wait_seconds: measured_wait,
        dispatch_latency_seconds: Spread::of(latency),
        handoff_seconds: handoff,
        processors,
        window_concurrency,
        window_utilization: in_service_mean / window_concurrency as f64,
        simulated_window_wait_seconds: simulated_window,
        recommended_concurrency: recommended,
        simulated_wait_seconds: simulated,
        wait_by_concurrency: curve,
        unreachable,
        configured_concurrency: configured,
        configured_from: "",
    };
    (report, series(kind, window, quantile_of))
}

/// How many attempts were in service over time: the count after each start (+1) and end
/// (-1) in time order, with a sparse table for the most over any span.
struct Busy {
    times: Vec<f64>,
    /// `most[k][i]`: the most in service after any of the edges `i .. i + 2^k`.
    most: Vec<Vec<usize>>,
}

impl Busy {
    fn of(attempts: &[Attempt]) -> Self {
        let mut edges: Vec<(f64, i64)> =
            attempts.iter().flat_map(|a| [(a.started, 1), (a.ended, -1)]).collect();
        // Ends before starts at the same instant.
        edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut now = 0i64;
        let counts: Vec<usize> = edges
            .iter()
            .map(|(_, step)| {
                now += step;
                usize::try_from(now).unwrap_or(0)
            })
            .collect();
        let mut most = vec![counts];
        while 1 << most.len() <= most[0].len() {
            let (half, last) = (1 << (most.len() - 1), &most[most.len() - 1]);
            let next =
                (0..last.len().saturating_sub(half)).map(|i| last[i].max(last[i + half])).collect();
            most.push(next);
        }
        Self { times: edges.into_iter().map(|(t, _)| t).collect(), most }
    }

    /// The most in service at any instant of `[from, to)`.
    fn most(&self, from: f64, to: f64) -> usize {
        let first = self.times.partition_point(|&t| t < from);
        let end = self.times.partition_point(|&t| t < to);
        let before = if first == 0 { 0 } else { self.most[0][first - 1] };
        if end <= first {
            return before;
        }
        let level = (usize::BITS - 1 - (end - first).leading_zeros()) as usize;
        let span = self.most[level][first].max(self.most[level][end - (1 << level)]);
        before.max(span)
    }
}

/// The window's attempts as the simulation's customers, in the order they join the queue,
/// and the dispatch latencies measured: the waits of the attempts that found a free worker
/// — fewer than `concurrency` in service from when they became ready until they started.
/// Such an attempt joins at its own latency; one that queued, at the measured latencies
/// taken in turn; one ready before the window, at its start (it holds a server; its wait
/// is not counted).
fn customers(attempts: &[Attempt], concurrency: usize) -> (Vec<f64>, Vec<f64>, Vec<Customer>) {
    let busy = Busy::of(attempts);
    let mut ready: Vec<&Attempt> = attempts.iter().filter(|a| a.ready.is_some()).collect();
    ready.sort_by(|a, b| a.ready.unwrap_or(0.0).total_cmp(&b.ready.unwrap_or(0.0)));
    let free: Vec<bool> = ready
        .iter()
        .map(|a| busy.most(a.ready.unwrap_or(a.started), a.started) < concurrency)
        .collect();
    let mut latency: Vec<f64> = ready
        .iter()
        .zip(&free)
        .filter(|(_, free)| **free)
        .map(|(a, _)| a.started - a.ready.unwrap_or(a.started))
        .collect();
    if latency.is_empty() {
        // Every attempt queued: the shortest waits are the nearest to a dispatch's own time.
        let mut waits: Vec<f64> =
            ready.iter().map(|a| a.started - a.ready.unwrap_or(a.started)).collect();
        waits.sort_by(f64::total_cmp);
        latency.push(quantile(&waits, 0.05));
    }
    let mut turn = 0;
    let mut customers: Vec<Customer> = ready
        .iter()
        .zip(&free)
        .map(|(a, free)| {
            let ready = a.ready.unwrap_or(a.started);
            let delay = if *free {
                a.started - ready
            } else {
                turn += 1;
                latency[(turn - 1) % latency.len()]
            };
            Customer { ready, enters: ready + delay, service: a.ended - a.started, counted: true }
        })
        .collect();
    customers.extend(attempts.iter().filter(|a| a.ready.is_none()).map(|a| Customer {
        ready: a.started,
        enters: a.started,
        service: a.ended - a.started,
        counted: false,
    }));
    customers.sort_by(|a, b| a.enters.total_cmp(&b.enters));
    // A queued attempt starts when a worker comes free: after the latest end before its
    // start, if that end came after it was ready.
    let mut ends: Vec<f64> = attempts.iter().map(|a| a.ended).collect();
    ends.sort_by(f64::total_cmp);
    let handoffs = ready
        .iter()
        .zip(&free)
        .filter(|(_, free)| !**free)
        .filter_map(|(a, _)| {
            let before = ends.partition_point(|&e| e <= a.started);
            let freed = *ends.get(before.checked_sub(1)?)?;
            (freed >= a.ready.unwrap_or(a.started)).then_some(a.started - freed)
        })
        .collect();
    (latency, handoffs, customers)
}

/// `customers` with every service time lengthened by `headroom` (0.1: 10%).
fn lengthened(customers: &[Customer], headroom: f64) -> Vec<Customer> {
    customers.iter().map(|c| Customer { service: c.service * (1.0 + headroom), ..*c }).collect()
}

/// The least number of servers, at least `least`, whose simulated `objective.quantile` wait
/// is within the objective, and that wait. Waits never grow with more servers, so a binary
/// search; at most one server per customer. `Err` with the wait a server for every customer
/// gives when even that is past the objective: the dispatch latency alone is.
fn recommend(
    customers: &[Customer],
    objective: Objective,
    least: usize,
) -> Result<(usize, f64), f64> {
    let wait_at = |servers: usize| simulate(customers, servers, objective.quantile);
    let (mut low, mut high) = (least.max(1), customers.len().max(least).max(1));
    let unhurried = wait_at(high);
    if unhurried > objective.wait {
        return Err(unhurried);
    }
    while low < high {
        let mid = (low + high) / 2;
        if wait_at(mid) <= objective.wait { high = mid } else { low = mid + 1 }
    }
    Ok((low, wait_at(low)))
}

/// The simulated `quantile` wait at each concurrency from `from` to two past `to`: at most
/// 64 points, the last of them `to + 2`.
fn wait_curve(customers: &[Customer], quantile: f64, from: usize, to: usize) -> Vec<CurvePoint> {
    let (from, to) = (from.max(1), to.max(from.max(1)) + 2);
    let step = (to - from).div_ceil(63).max(1);
    let mut points: Vec<usize> = (from..to).step_by(step).collect();
    points.push(to);
    points
        .into_iter()
        .map(|c| CurvePoint { concurrency: c, wait_seconds: simulate(customers, c, quantile) })
        .collect()
}

/// The `quantile` wait (from ready to start) of the counted `customers`, in the order they
/// join a FIFO queue served by `servers`.
fn simulate(customers: &[Customer], servers: usize, quantile_of: f64) -> f64 {
    // Min-heap of the times the servers come free, as ordered integers (nanoseconds).
    let mut free: BinaryHeap<std::cmp::Reverse<i64>> = BinaryHeap::with_capacity(servers);
    let mut waits = Vec::with_capacity(customers.len());
    for customer in customers {
        let enters = (customer.enters * 1e9) as i64;
        let start = if free.len() < servers {
            enters
        } else {
            let std::cmp::Reverse(first) = free.pop().expect("a server");
            first.max(enters)
        };
        if customer.counted {
            waits.push(start as f64 / 1e9 - customer.ready);
        }
        free.push(std::cmp::Reverse(start + (customer.service * 1e9) as i64));
    }
    waits.sort_by(f64::total_cmp);
    quantile(&waits, quantile_of)
}

/// Arrivals a second and attempts in service (time-averaged) per bucket, and the
/// `quantile` wait over spans of buckets with at least [`min_jobs`] attempts started in
/// them (the last span takes what is left over).
fn series(kind: &Kind, window: f64, quantile_of: f64) -> Series {
    let width = window / BUCKETS as f64;
    let bucket = |t: f64| ((t / width).floor().max(0.0) as usize).min(BUCKETS - 1);
    let mut arrivals = vec![0.0; BUCKETS];
    for t in &kind.arrivals {
        arrivals[bucket(*t)] += 1.0 / width;
    }
    let mut busy = vec![0.0; BUCKETS];
    let mut waits: Vec<Vec<f64>> = vec![Vec::new(); BUCKETS];
    for a in &kind.attempts {
        if let Some(ready) = a.ready {
            waits[bucket(a.started)].push(a.started - ready);
        }
        let (from, to) = (a.started.max(0.0), a.ended.min(window));
        let mut b = bucket(from);
        while b < BUCKETS && (b as f64) * width < to {
            let (start, end) = ((b as f64) * width, ((b + 1) as f64) * width);
            busy[b] += (to.min(end) - from.max(start)).max(0.0) / width;
            b += 1;
        }
    }
    let least = min_jobs(quantile_of);
    let mut spans: Vec<(f64, f64, Vec<f64>)> = Vec::new();
    let mut current: (f64, Vec<f64>) = (0.0, Vec::new());
    for (b, w) in waits.into_iter().enumerate() {
        current.1.extend(w);
        if current.1.len() >= least {
            let end = (b + 1) as f64 * width;
            spans.push((current.0, end, std::mem::take(&mut current.1)));
            current.0 = end;
        }
    }
    if !current.1.is_empty() {
        match spans.last_mut() {
            Some(last) => {
                last.1 = window;
                last.2.extend(current.1);
            }
            None => spans.push((0.0, window, current.1)),
        }
    }
    let waits = spans
        .into_iter()
        .map(|(from, to, mut w)| {
            w.sort_by(f64::total_cmp);
            (from, to, quantile(&w, quantile_of))
        })
        .collect();
    Series {
        bucket_seconds: width,
        arrivals_per_second: arrivals,
        in_service: busy,
        quantile: quantile_of,
        min_jobs: least,
        waits,
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "window: {} .. {} ({:.1} s), read from {}",
            self.window_start.to_rfc3339(),
            self.window_end.to_rfc3339(),
            self.window_seconds,
            self.source
        )?;
        if let Some(o) = self.objective {
            writeln!(
                f,
                "objective: p{} queue wait ≤ {:.3} s, with {:.0}% headroom on service times",
                o.quantile * 100.0,
                o.wait,
                o.headroom * 100.0
            )?;
            writeln!(f, "method: {}", self.method)?;
        }
        writeln!(f)?;
        for k in &self.kinds {
            let q = self.objective.map_or(0.99, |o| o.quantile);
            let p = percentile_name(q);
            writeln!(f, "kind {}", k.kind)?;
            writeln!(f, "  arrivals        {} ({:.3}/s)", k.arrivals, k.arrival_rate)?;
            let s = &k.service_seconds;
            writeln!(
                f,
                "  service time    p50 {:.3} s  p90 {:.3} s  p99 {:.3} s  mean {:.3} s  ({} attempts, \
                 each from its lease's start)",
                s.p50, s.p90, s.p99, s.mean, k.attempts
            )?;
            writeln!(f, "  retry share     {:.1}%", k.retry_share * 100.0)?;
            writeln!(
                f,
                "  in service      {:.2} on average (Little's law), {} at the peak",
                k.in_service_mean, k.in_service_peak
            )?;
            let ran = if k.window_concurrency > k.configured_concurrency * k.processors {
                format!(
                    "the peak in service, more than the {} configured here: run this with the \
                     processors' configuration",
                    k.configured_concurrency * k.processors
                )
            } else {
                format!(
                    "{} per processor × {} processor(s)",
                    k.configured_concurrency, k.processors
                )
            };
            writeln!(
                f,
                "  window ran at   {} workers ({ran}), {:.0}% busy",
                k.window_concurrency,
                k.window_utilization * 100.0
            )?;
            let w = &k.wait_seconds;
            writeln!(
                f,
                "  queue wait      p50 {:.3} s  p99 {:.3} s  ({} attempts ready in the window)",
                w.p50, w.p99, w.count
            )?;
            let d = &k.dispatch_latency_seconds;
            writeln!(
                f,
                "  dispatch        p50 {:.3} s  p90 {:.3} s  p99 {:.3} s  ({} attempts that found a \
                 free worker)",
                d.p50, d.p90, d.p99, d.count
            )?;
            let h = &k.handoff_seconds;
            if h.count > 0 {
                writeln!(
                    f,
                    "  handoff         mean {:.4} s  p99 {:.3} s  (a freed worker to the next queued \
                     attempt, {} attempts)",
                    h.mean, h.p99, h.count
                )?;
            }
            if let Some(simulated) = k.simulated_window_wait_seconds {
                writeln!(
                    f,
                    "  replayed        {p} wait {simulated:.3} s simulated at the window's {} \
                     workers, {:.3} s measured",
                    k.window_concurrency, k.measured_wait_seconds
                )?;
            }
            if let (Some(c), Some(wait), Some(u)) =
                (k.recommended_concurrency, k.simulated_wait_seconds, k.utilization)
            {
                writeln!(
                    f,
                    "  concurrency     {c} needed for the group (simulated {p} wait {wait:.3} s with \
                     the headroom, {:.0}% busy); configured {} per processor ({})",
                    u * 100.0,
                    k.configured_concurrency,
                    k.configured_from
                )?;
                let near: Vec<String> = k
                    .wait_by_concurrency
                    .iter()
                    .filter(|point| point.concurrency + 3 >= c && point.concurrency <= c + 3)
                    .map(|point| format!("{} → {:.3} s", point.concurrency, point.wait_seconds))
                    .collect();
                writeln!(f, "  {p} wait by workers  {}", near.join(", "))?;
            } else {
                if let Some(why) = &k.unreachable {
                    writeln!(f, "  concurrency     {why}")?;
                }
                writeln!(
                    f,
                    "  concurrency     configured {} per processor ({})",
                    k.configured_concurrency, k.configured_from
                )?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// "p99" for 0.99, "p99.9" for 0.999.
fn percentile_name(q: f64) -> String {
    let percent = format!("{:.3}", q * 100.0);
    format!("p{}", percent.trim_end_matches('0').trim_end_matches('.'))
}

impl Report {
    /// Writes the figures as JSON to `path`.
    ///
    /// # Errors
    /// The file could not be written.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// Plots, per kind, one panel under another, as an SVG at `path`: arrivals a second;
    /// workers busy against the window's concurrency and the recommended one; the queue
    /// wait's quantile over spans of enough jobs against the objective; and, with an
    /// objective, the simulated wait by number of workers, where the answer is read.
    ///
    /// # Errors
    /// The file could not be written or drawn.
    pub fn write_plot(&self, path: &Path) -> anyhow::Result<()> {
        use plotters::prelude::*;
        let panels: Vec<usize> = self
            .kinds
            .iter()
            .filter(|k| self.series.contains_key(&k.kind))
            .map(|k| if k.recommended_concurrency.is_some() { 4 } else { 3 })
            .collect();
        let total = panels.iter().sum::<usize>().max(1);
        let root = SVGBackend::new(path, (960, 230 * total as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let rows = root.split_evenly((total, 1));
        let mut rows = rows.iter();
        let grey = RGBColor(120, 120, 120);
        for k in &self.kinds {
            let Some(series) = self.series.get(&k.kind) else { continue };
            let name = &k.kind;
            let p = percentile_name(series.quantile);
            let t: Vec<f64> =
                (0..BUCKETS).map(|b| (b as f64 + 0.5) * series.bucket_seconds).collect();
            let window = self.window_seconds;
            let seconds = "seconds into the window";

            let top = series.arrivals_per_second.iter().copied().fold(0.0, f64::max);
            let mut chart = panel(
                rows.next(),
                format!("{name}: arrivals / s"),
                0.0..window,
                top,
                seconds,
                false,
            )?;
            chart.draw_series(LineSeries::new(
                t.iter().copied().zip(series.arrivals_per_second.iter().copied()),
                &BLUE,
            ))?;

            // The window's concurrency is drawn when it is near what ran: 256 slots would
            // flatten a line of 10 in service.
            let busiest =
                series.in_service.iter().copied().fold(k.in_service_peak as f64, f64::max);
            let shown = (k.window_concurrency as f64) <= busiest * 2.0 + 2.0;
            let top = busiest.max(k.recommended_concurrency.unwrap_or(0) as f64).max(if shown {
                k.window_concurrency as f64
            } else {
                0.0
            });
            let caption = format!(
                "{name}: workers busy, on average {:.0}% of the {} the window ran with",
                k.window_utilization * 100.0,
                k.window_concurrency
            );
            let mut chart = panel(rows.next(), caption, 0.0..window, top, seconds, false)?;
            chart
                .draw_series(LineSeries::new(
                    t.iter().copied().zip(series.in_service.iter().copied()),
                    &GREEN,
                ))?
                .label("in service")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], GREEN));
            let level = |c: f64| [(0.0, c), (window, c)];
            if shown {
                chart
                    .draw_series(LineSeries::new(level(k.window_concurrency as f64), &grey))?
                    .label(format!("window concurrency ({})", k.window_concurrency))
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], grey));
            }
            if let Some(c) = k.recommended_concurrency {
                chart
                    .draw_series(LineSeries::new(level(c as f64), &MAGENTA))?
                    .label(format!("recommended ({c})"))
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], MAGENTA));
            }
            legend(&mut chart)?;

            let objective = self.objective.map(|o| o.wait);
            let top = series.waits.iter().map(|w| w.2).fold(objective.unwrap_or(0.0), f64::max);
            let caption = format!(
                "{name}: queue wait {p} (s), each step over at least {} jobs",
                series.min_jobs
            );
            let mut chart = panel(rows.next(), caption, 0.0..window, top, seconds, false)?;
            chart
                .draw_series(LineSeries::new(
                    series.waits.iter().flat_map(|&(from, to, w)| [(from, w), (to, w)]),
                    &RED,
                ))?
                .label(format!("measured {p}"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED));
            if let Some(wait) = objective {
                chart
                    .draw_series(LineSeries::new(level(wait), &BLACK))?
                    .label(format!("objective ({wait} s)"))
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
            }
            legend(&mut chart)?;

            if let (Some(o), Some(c), [first, .., last]) =
                (self.objective, k.recommended_concurrency, k.wait_by_concurrency.as_slice())
            {
                // Near the stable floor the waits run away: the panel shows one and a half
                // to four times the objective.
                let longest =
                    k.wait_by_concurrency.iter().map(|p| p.wait_seconds).fold(0.0, f64::max);
                let top = longest.clamp(o.wait * 1.5, o.wait * 4.0);
                let range = first.concurrency as f64 - 0.5..last.concurrency as f64 + 0.5;
                let caption = format!(
                    "{name}: simulated {p} wait (s) by workers, service {:.0}% longer",
                    o.headroom * 100.0
                );
                let mut chart =
                    panel(rows.next(), caption, range.clone(), top, "workers for the group", true)?;
                let points: Vec<(f64, f64)> = k
                    .wait_by_concurrency
                    .iter()
                    .map(|point| (point.concurrency as f64, point.wait_seconds.min(top)))
                    .collect();
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), &RED))?
                    .label(format!("simulated {p}"))
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED));
                chart.draw_series(points.iter().map(|&xy| Circle::new(xy, 3, RED.filled())))?;
                let level = [(range.start, o.wait), (range.end, o.wait)];
                chart
                    .draw_series(LineSeries::new(level, &BLACK))?
                    .label(format!("objective ({} s)", o.wait))
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
                let upright = |c: usize| [(c as f64, 0.0), (c as f64, top)];
                chart
                    .draw_series(LineSeries::new(upright(c), &MAGENTA))?
                    .label(format!("recommended ({c})"))
                    .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], MAGENTA));
                if range.contains(&(k.window_concurrency as f64)) {
                    chart
                        .draw_series(LineSeries::new(upright(k.window_concurrency), &grey))?
                        .label(format!("window concurrency ({})", k.window_concurrency))
                        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], grey));
                }
                legend(&mut chart)?;
            }
        }
        root.present().with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

type Panel<'a, 'b> = plotters::chart::ChartContext<
    'a,
    plotters::backend::SVGBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<
        plotters::coord::types::RangedCoordf64,
        plotters::coord::types::RangedCoordf64,
    >,
>;

/// One panel: a caption, the x range (labelled at whole numbers only if `whole`), a y axis
/// from 0 to a little above `top`, a grid.
fn panel<'a, 'b>(
    area: Option<
        &'a plotters::drawing::DrawingArea<
            plotters::backend::SVGBackend<'b>,
            plotters::coord::Shift,
        >,
    >,
    caption: String,
    x: std::ops::Range<f64>,
    top: f64,
    x_desc: &str,
    whole: bool,
) -> anyhow::Result<Panel<'a, 'b>> {
    use plotters::prelude::*;
    let area = area.context("a panel more than the plot was divided into")?;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .margin_right(40)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x, 0.0..top.max(1e-3) * 1.15)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(x_desc);
    if whole {
        // Workers come whole: no label between them.
        mesh.x_label_formatter(&|x: &f64| {
            if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
        });
    }
    mesh.draw()?;
    Ok(chart)
}

/// The panel's legend, in its upper right corner.
fn legend<'a, 'b: 'a>(chart: &mut Panel<'a, 'b>) -> anyhow::Result<()> {
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(ready: f64, service: f64) -> Attempt {
        Attempt { ready: Some(ready), started: ready, ended: ready + service, failed: false }
    }

    fn customer(ready: f64, service: f64) -> Customer {
        Customer { ready, enters: ready, service, counted: true }
    }

    #[test]
    fn the_simulation_queues_what_the_servers_cannot_take() {
        // Four jobs of 1 s at once: one server makes them wait 0, 1, 2, 3 s; two, 0, 0, 1, 1.
        let at_once: Vec<Customer> = (0..4).map(|_| customer(0.0, 1.0)).collect();
        assert_eq!(simulate(&at_once, 1, 1.0), 3.0);
        assert_eq!(simulate(&at_once, 2, 1.0), 1.0);
        assert_eq!(simulate(&at_once, 4, 1.0), 0.0);
        // Spaced out by their service time, one server suffices.
        let spaced: Vec<Customer> = (0..4).map(|i| customer(f64::from(i), 1.0)).collect();
        assert_eq!(simulate(&spaced, 1, 1.0), 0.0);
        // A dispatch latency is part of the wait; a customer not counted still holds a server.
        let late = Customer { enters: 0.25, ..customer(0.0, 1.0) };
        assert_eq!(simulate(&[late], 1, 1.0), 0.25);
        let held = Customer { counted: false, ..customer(0.0, 1.0) };
        assert_eq!(simulate(&[held, customer(0.0, 1.0)], 1, 1.0), 1.0);
    }

    #[test]
    fn the_recommendation_is_the_least_concurrency_meeting_the_objective() {
        let customers: Vec<Customer> = (0..10).map(|_| customer(0.0, 1.0)).collect();
        let objective = Objective { wait: 1.5, quantile: 1.0, headroom: 0.0 };
        // Ten at once, 1 s each: 5 servers → waits up to 1 s; 4 → up to 2 s.
        assert_eq!(recommend(&customers, objective, 1), Ok((5, 1.0)));
        // 0.6 s of dispatch latency leaves 0.9 s: ten servers.
        let late: Vec<Customer> =
            customers.iter().map(|c| Customer { enters: 0.6, ..*c }).collect();
        assert_eq!(recommend(&late, objective, 1), Ok((10, 0.6)));
        // 1.6 s of latency: no number of servers meets 1.5 s.
        let later: Vec<Customer> =
            customers.iter().map(|c| Customer { enters: 1.6, ..*c }).collect();
        assert_eq!(recommend(&later, objective, 1), Err(1.6));
        // Never below the least it is given (the stable concurrency).
        assert_eq!(recommend(&customers, objective, 7), Ok((7, 1.0)));
        // With 50% headroom the jobs count as 1.5 s: five servers still meet 1.5 s ...
        assert_eq!(recommend(&lengthened(&customers, 0.5), objective, 1), Ok((5, 1.5)));
        // ... and with 60%, 1.6 s jobs: any wait is too long, so one server each.
        assert_eq!(recommend(&lengthened(&customers, 0.6), objective, 1), Ok((10, 0.0)));
        // The curve runs from the floor to two past the answer, falling.
        let curve = wait_curve(&customers, 1.0, 3, 5);
        let points: Vec<(usize, f64)> =
            curve.iter().map(|p| (p.concurrency, p.wait_seconds)).collect();
        assert_eq!(points, [(3, 3.0), (4, 2.0), (5, 1.0), (6, 1.0), (7, 1.0)]);
    }

    #[test]
    fn an_attempt_starts_at_its_lease_not_at_its_event() {
        // A run inside its lease transaction: leased at 10.000, stamped at 10.020.
        assert!((lease_start(10.0, Some(9.9), 10.02) - 10.0).abs() < 1e-9);
        // Never before its job was ready, nor after its event (a TTL configured otherwise).
        assert_eq!(lease_start(9.0, Some(9.9), 10.02), 9.9);
        assert_eq!(lease_start(11.0, Some(9.9), 10.02), 10.02);
        assert_eq!(lease_start(10.0, None, 10.02), 10.0);
    }

    #[test]
    fn dispatch_latency_comes_from_attempts_that_found_a_free_worker() {
        // One worker; a job every second taking 1.5 s, each dispatched 0.1 s after it is
        // ready when the worker is free. Job 0 finds it free (waits 0.1 s); job 1 arrives
        // while job 0 runs and waits for it.
        let attempts = vec![
            Attempt { ready: Some(0.0), started: 0.1, ended: 1.6, failed: false },
            Attempt { ready: Some(1.0), started: 1.6, ended: 3.1, failed: false },
            Attempt { ready: Some(5.0), started: 5.2, ended: 6.7, failed: false },
            // Ready before the window: it holds the worker, its wait is not counted.
            Attempt { ready: None, started: 7.0, ended: 7.5, failed: false },
        ];
        let (latency, _, customers) = customers(&attempts, 1);
        assert_eq!(latency.len(), 2);
        assert!((latency[0] - 0.1).abs() < 1e-9 && (latency[1] - 0.2).abs() < 1e-9);
        // Job 1 queued: it joins at the measured latencies taken in turn (0.1 s first).
        assert!((customers[1].enters - 1.1).abs() < 1e-9, "{customers:?}");
        assert_eq!(customers.iter().filter(|c| c.counted).count(), 3);
        // Replayed at the window's concurrency, the simulation gives the waits measured:
        // 0.1, 0.6 and 0.2 s.
        for (q, wanted) in [(0.33, 0.1), (0.66, 0.2), (1.0, 0.6)] {
            assert!((simulate(&customers, 1, q) - wanted).abs() < 1e-6, "q {q}");
        }
    }

    #[test]
    fn an_attempt_ready_in_a_handoffs_gap_still_queued() {
        // One worker. A runs 0..1; B, ready at 0.5, starts 10 ms after A ends; C, ready in
        // that gap (nothing in service at its instant), starts after B.
        let attempts = vec![
            Attempt { ready: Some(0.0), started: 0.0, ended: 1.0, failed: false },
            Attempt { ready: Some(0.5), started: 1.01, ended: 2.0, failed: false },
            Attempt { ready: Some(1.005), started: 2.01, ended: 3.0, failed: false },
        ];
        let busy = Busy::of(&attempts);
        assert_eq!(busy.most(1.005, 1.005), 0);
        assert_eq!(busy.most(1.005, 2.01), 1);
        assert_eq!(busy.most(0.0, 3.0), 1);
        let (latency, handoffs, _) = customers(&attempts, 1);
        assert_eq!(latency, [0.0], "only A found the worker free");
        // B and C each started 10 ms after the end that freed the worker.
        assert_eq!(handoffs.len(), 2);
        assert!(handoffs.iter().all(|h| (h - 0.01).abs() < 1e-9), "{handoffs:?}");
    }

    #[test]
    fn figures_follow_littles_law_and_find_the_peak() {
        // One job a second for 100 s, 2 s each: 2 in service on average and at the peak.
        let kind = Kind {
            arrivals: (0..100).map(f64::from).collect(),
            attempts: (0..100).map(|i| attempt(f64::from(i), 2.0)).collect(),
            owners: HashSet::from(["host/1".to_owned()]),
        };
        let (report, series) = figures("k", &kind, 100.0, None, 4);
        assert!((report.arrival_rate - 1.0).abs() < 1e-9);
        assert!((report.in_service_mean - 2.0).abs() < 1e-9);
        assert_eq!(report.in_service_peak, 2);
        assert_eq!(report.service_seconds.p99, 2.0);
        // 4 configured, 2 ever in service: the window could run 4, half busy.
        assert_eq!((report.processors, report.window_concurrency), (1, 4));
        assert!((report.window_utilization - 0.5).abs() < 1e-9);
        // Configured for 1 here, but 2 ran: the processors were configured otherwise.
        let (report, _) = figures("k", &kind, 100.0, None, 1);
        assert_eq!(report.window_concurrency, 2);
        let middle = series.in_service[BUCKETS / 2];
        assert!((middle - 2.0).abs() < 1e-6, "{middle}");
        // The wait quantile is taken over spans of at least 300 jobs: one span of 100 here.
        assert_eq!(series.min_jobs, 300);
        assert_eq!(series.waits, [(0.0, 100.0, 0.0)]);
    }

    /// Erlang C: the probability an arrival waits in M/M/c with `load` Erlangs.
    fn erlang_c(servers: usize, load: f64) -> f64 {
        let mut b = 1.0;
        for k in 1..=servers {
            b = load * b / (k as f64 + load * b);
        }
        let rho = load / servers as f64;
        if rho >= 1.0 { 1.0 } else { b / (1.0 - rho + rho * b) }
    }

    /// The `q` quantile of the wait in M/M/c: P(W > t) = C e^(-(cμ - λ) t).
    fn erlang_quantile(servers: usize, rate: f64, hold: f64, q: f64) -> f64 {
        let waits = erlang_c(servers, rate * hold);
        if waits <= 1.0 - q {
            0.0
        } else {
            (waits / (1.0 - q)).ln() / (servers as f64 / hold - rate)
        }
    }

    #[test]
    fn on_a_long_m_m_c_trace_the_simulation_agrees_with_erlang_c() {
        use rand::{Rng, SeedableRng};
        // 200,000 Poisson arrivals at 15/s, exponential service of mean 200 ms: 3 Erlangs.
        // Within 10% plus 10 ms: the p99 of one such trace varies by a few percent with its
        // seed (at 4 servers, 0.76-0.81 s in three seeds against Erlang C's 0.786 s).
        let (rate, hold) = (15.0, 0.2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(51);
        let mut exponential = |mean: f64| -(1.0 - rng.random::<f64>()).ln() * mean;
        let mut at = 0.0;
        let customers: Vec<Customer> = (0..200_000)
            .map(|_| {
                at += exponential(1.0 / rate);
                customer(at, exponential(hold))
            })
            .collect();
        for servers in 4..=7 {
            let known = erlang_quantile(servers, rate, hold, 0.99);
            let simulated = simulate(&customers, servers, 0.99);
            assert!(
                (simulated - known).abs() <= 0.1 * known + 0.01,
                "{servers} servers: p99 simulated {simulated:.4} s, Erlang C {known:.4} s"
            );
        }
        // The least concurrency for each objective is Erlang C's.
        for wait in [1.0, 0.5, 0.25, 0.1] {
            let objective = Objective { wait, quantile: 0.99, headroom: 0.0 };
            let known = (4..).find(|&c| erlang_quantile(c, rate, hold, 0.99) <= wait).unwrap();
            let (c, _) = recommend(&customers, objective, 4).unwrap();
            assert_eq!(c, known, "p99 wait at most {wait} s");
        }
    }

    #[test]
    fn a_plotted_wait_quantile_covers_enough_jobs() {
        assert_eq!(min_jobs(0.99), 300);
        assert_eq!(min_jobs(0.999), 3000);
        assert_eq!(min_jobs(0.5), 50);
        assert_eq!(percentile_name(0.99), "p99");
        assert_eq!(percentile_name(0.999), "p99.9");
        assert_eq!(percentile_name(0.5), "p50");
    }
}
