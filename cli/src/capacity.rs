//! `jobfold capacity`: the figures a capacity decision needs, read from the job event log
//! (Kafka or Postgres) over a window, per kind.
//!
//! - **arrivals**: `JobRequested` events (a scheduled job arrives at its `run_at`), per second;
//! - **service time**: from an attempt's `JobLeased` to its `JobSucceeded` or `JobFailed`
//!   (or the `JobSuperseded` that ended it) — handler run plus lease and completion;
//! - **retry share**: attempts that failed, of all attempts that ended;
//! - **in service**: on average by Little's law (attempts a second × mean service time), and
//!   at the peak (the most attempts between lease and end at one instant);
//! - **queue wait**: from when a job could run (its arrival, its retry's due time, a replay)
//!   to its lease.
//!
//! Given a waiting-time objective (`--wait 2s`, at `--quantile 0.99`), it finds the least
//! concurrency meeting it **by simulation, driven by the log itself**: the window's
//! dispatches, at their own ready times and with their own service times, go through a FIFO
//! queue with that many servers, and each simulated wait gets the dispatch latency the log
//! shows when nothing queued (the 5th percentile of the measured waits: relay, Kafka, lease)
//! added. No distribution is assumed. It never answers less than the mean in service plus
//! one: below that the queue grows without end, and a finite window could hide it. The
//! answer is for the group as a whole (the sum over
//! its processors of the kind's `concurrency`, or of `processor.max_in_flight`).
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

/// One attempt: when it could have run, when it was leased, when it ended.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    ready: f64,
    leased: f64,
    ended: f64,
    failed: bool,
}

/// A job being read: its next dispatch's ready time, its open lease.
#[derive(Debug, Default)]
struct Open {
    last_version: i32,
    ready: Option<f64>,
    lease: Option<(i64, f64, f64)>,
}

/// What one kind did in the window.
#[derive(Debug, Default)]
struct Kind {
    arrivals: Vec<f64>,
    attempts: Vec<Attempt>,
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
    pub wait_seconds: Spread,
    /// The 5th percentile of the waits: what a dispatch takes when nothing queues.
    pub dispatch_latency_seconds: f64,
    /// For the objective: the least concurrency meeting it in the simulation, and the wait
    /// quantile simulated there (dispatch latency included).
    pub recommended_concurrency: Option<usize>,
    pub simulated_wait_seconds: Option<f64>,
    /// Jobs in service on average over the recommended concurrency: below 1.
    pub utilization: Option<f64>,
    /// What one processor is configured with: the kind's `concurrency`, else
    /// `processor.max_in_flight`.
    pub configured_concurrency: usize,
    pub configured_from: &'static str,
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

/// A kind's figures in equal buckets of the window.
#[derive(Debug, Clone, Default)]
struct Series {
    bucket_seconds: f64,
    arrivals_per_second: Vec<f64>,
    in_service: Vec<f64>,
    wait_p99: Vec<f64>,
}

/// Buckets the plot divides the window into.
const BUCKETS: usize = 120;

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
    while let Some(batch) = reader.next().await? {
        for (_, frame) in batch {
            let Ok(event) = decoder.decode(&frame).await else { continue };
            // Past the window's end, only the ends of attempts leased within it count.
            let after = options.until.is_some_and(|until| event.occurred_at > until);
            if after
                && !matches!(
                    event.payload,
                    Payload::JobSucceeded(_)
                        | Payload::JobFailed(_)
                        | Payload::JobSuperseded(_)
                        | Payload::JobCancelled(_)
                )
            {
                continue;
            }
            let origin = *anchor.get_or_insert(event.occurred_at);
            let at = seconds(event.occurred_at, origin);
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
                if let Some((leased_generation, ready, leased)) = job.lease
                    && leased_generation == generation
                {
                    kind.attempts.push(Attempt { ready, leased, ended: at, failed });
                    job.lease = None;
                }
            };
            let mut finished = false;
            match &event.payload {
                Payload::JobRequested(requested) => {
                    let ready = requested.run_at.map_or(at, |r| seconds(r, origin).max(at));
                    kind.arrivals.push(ready);
                    job.ready = Some(ready);
                }
                Payload::RetryDue(due) => {
                    job.ready = Some(seconds(due.due_at, origin).max(at));
                }
                Payload::ReplayRequested(_) => job.ready = Some(at),
                Payload::JobLeased(leased) => {
                    let ready = job.ready.take().unwrap_or(at).min(at);
                    job.lease = Some((leased.generation, ready, at));
                }
                Payload::JobSucceeded(s) => {
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
            (a.ready, a.leased, a.ended) = (a.ready - start, a.leased - start, a.ended - start);
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
        method: "trace-driven simulation: the window's own dispatches through a FIFO queue \
                 of c servers, service times lengthened by the headroom, plus the measured \
                 dispatch latency; c above the mean in service (with the headroom), below \
                 which the queue grows without end",
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
        let (figures, series) = figures(&name, &kind, window, options.objective);
        report.kinds.push(KindReport { configured_concurrency, configured_from, ..figures });
        report.series.insert(name, series);
    }
    Ok(report)
}

fn seconds(at: DateTime<Utc>, origin: DateTime<Utc>) -> f64 {
    (at - origin).num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6
}

/// One kind's figures over a window of `window` seconds.
fn figures(
    name: &str,
    kind: &Kind,
    window: f64,
    objective: Option<Objective>,
) -> (KindReport, Series) {
    let service: Vec<f64> = kind.attempts.iter().map(|a| a.ended - a.leased).collect();
    let waits: Vec<f64> = kind.attempts.iter().map(|a| a.leased - a.ready).collect();
    let service_seconds = Spread::of(service);
    let wait_seconds = Spread::of(waits.clone());
    let mut sorted_waits = waits;
    sorted_waits.sort_by(f64::total_cmp);
    let dispatch_latency = quantile(&sorted_waits, 0.05);
    let failed = kind.attempts.iter().filter(|a| a.failed).count();
    let attempts = kind.attempts.len();
    // The most attempts in service at once: +1 at each lease, -1 at each end.
    let mut edges: Vec<(f64, i64)> =
        kind.attempts.iter().flat_map(|a| [(a.leased, 1), (a.ended, -1)]).collect();
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, step) in edges {
        now += step;
        peak = peak.max(now);
    }
    let in_service_mean = attempts as f64 / window * service_seconds.mean;
    let (recommended, simulated) = match objective {
        Some(objective) if attempts > 0 => {
            // Below the mean in service the queue grows without end: a finite window could
            // still show waits within the objective, so the search starts above it.
            let stable = (in_service_mean * (1.0 + objective.headroom)).floor() as usize + 1;
            let (c, wait) = recommend(&kind.attempts, dispatch_latency, objective, stable);
            (Some(c), Some(wait))
        }
        _ => (None, None),
    };
    let report = KindReport {
        kind: name.to_owned(),
        arrivals: kind.arrivals.len(),
        arrival_rate: kind.arrivals.len() as f64 / window,
        attempts,
        retry_share: if attempts == 0 { 0.0 } else { failed as f64 / attempts as f64 },
        in_service_mean,
        utilization: recommended.map(|c| in_service_mean / c as f64),
        in_service_peak: usize::try_from(peak).unwrap_or(0),
        service_seconds,
        wait_seconds,
        dispatch_latency_seconds: dispatch_latency,
        recommended_concurrency: recommended,
        simulated_wait_seconds: simulated,
        configured_concurrency: 0,
        configured_from: "",
    };
    (report, series(kind, window))
}

/// The least number of servers, at least `least`, whose simulated `objective.quantile` wait
/// (plus `latency`) is within the objective with every service time lengthened by the
/// objective's headroom, and that wait. Waits never grow with more servers, so a binary
/// search; at most one server per attempt.
fn recommend(
    attempts: &[Attempt],
    latency: f64,
    objective: Objective,
    least: usize,
) -> (usize, f64) {
    let mut customers: Vec<(f64, f64)> = attempts
        .iter()
        .map(|a| (a.ready, (a.ended - a.leased) * (1.0 + objective.headroom)))
        .collect();
    customers.sort_by(|a, b| a.0.total_cmp(&b.0));
    let wait_at = |servers: usize| latency + simulate(&customers, servers, objective.quantile);
    let (mut low, mut high) = (least.max(1), customers.len().max(least).max(1));
    if wait_at(high) > objective.wait {
        // Not even one server per attempt meets it: the latency alone is over the objective.
        return (high, wait_at(high));
    }
    while low < high {
        let mid = (low + high) / 2;
        if wait_at(mid) <= objective.wait { high = mid } else { low = mid + 1 }
    }
    (low, wait_at(low))
}

/// The `quantile` wait of `customers` (ready time, service time; in ready order) in a FIFO
/// queue served by `servers`.
fn simulate(customers: &[(f64, f64)], servers: usize, quantile_of: f64) -> f64 {
    // Min-heap of the times the servers come free, as ordered integers (nanoseconds).
    let mut free: BinaryHeap<std::cmp::Reverse<i64>> = BinaryHeap::with_capacity(servers);
    let mut waits = Vec::with_capacity(customers.len());
    for &(ready, service) in customers {
        let ready_ns = (ready * 1e9) as i64;
        let start = if free.len() < servers {
            ready_ns
        } else {
            let std::cmp::Reverse(first) = free.pop().expect("a server");
            first.max(ready_ns)
        };
        waits.push((start - ready_ns) as f64 / 1e9);
        free.push(std::cmp::Reverse(start + (service * 1e9) as i64));
    }
    waits.sort_by(f64::total_cmp);
    quantile(&waits, quantile_of)
}

/// Arrivals a second, attempts in service (time-averaged) and the 99th percentile wait of
/// the attempts leased, per bucket.
fn series(kind: &Kind, window: f64) -> Series {
    let width = window / BUCKETS as f64;
    let bucket = |t: f64| ((t / width).floor().max(0.0) as usize).min(BUCKETS - 1);
    let mut arrivals = vec![0.0; BUCKETS];
    for t in &kind.arrivals {
        arrivals[bucket(*t)] += 1.0 / width;
    }
    let mut busy = vec![0.0; BUCKETS];
    let mut waits: Vec<Vec<f64>> = vec![Vec::new(); BUCKETS];
    for a in &kind.attempts {
        waits[bucket(a.leased)].push(a.leased - a.ready);
        let (from, to) = (a.leased.max(0.0), a.ended.min(window));
        let mut b = bucket(from);
        while b < BUCKETS && (b as f64) * width < to {
            let (start, end) = ((b as f64) * width, ((b + 1) as f64) * width);
            busy[b] += (to.min(end) - from.max(start)).max(0.0) / width;
            b += 1;
        }
    }
    let wait_p99 = waits
        .into_iter()
        .map(|mut w| {
            w.sort_by(f64::total_cmp);
            quantile(&w, 0.99)
        })
        .collect();
    Series { bucket_seconds: width, arrivals_per_second: arrivals, in_service: busy, wait_p99 }
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
            writeln!(f, "kind {}", k.kind)?;
            writeln!(f, "  arrivals        {} ({:.3}/s)", k.arrivals, k.arrival_rate)?;
            let s = &k.service_seconds;
            writeln!(
                f,
                "  service time    p50 {:.3} s  p90 {:.3} s  p99 {:.3} s  mean {:.3} s  ({} attempts)",
                s.p50, s.p90, s.p99, s.mean, k.attempts
            )?;
            writeln!(f, "  retry share     {:.1}%", k.retry_share * 100.0)?;
            writeln!(
                f,
                "  in service      {:.2} on average (Little's law), {} at the peak",
                k.in_service_mean, k.in_service_peak
            )?;
            let w = &k.wait_seconds;
            writeln!(
                f,
                "  queue wait      p50 {:.3} s  p99 {:.3} s  (dispatch latency {:.3} s)",
                w.p50, w.p99, k.dispatch_latency_seconds
            )?;
            if let (Some(c), Some(wait), Some(u)) =
                (k.recommended_concurrency, k.simulated_wait_seconds, k.utilization)
            {
                writeln!(
                    f,
                    "  concurrency     {c} needed for the group (simulated wait {wait:.3} s, \
                     {:.0}% busy); configured {} per processor ({})",
                    u * 100.0,
                    k.configured_concurrency,
                    k.configured_from
                )?;
            } else {
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

impl Report {
    /// Writes the figures as JSON to `path`.
    ///
    /// # Errors
    /// The file could not be written.
    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// Plots, per kind, arrivals a second, jobs in service and the 99th percentile queue
    /// wait over the window, one panel each, as an SVG at `path`.
    ///
    /// # Errors
    /// The file could not be written.
    pub fn write_plot(&self, path: &Path) -> anyhow::Result<()> {
        use plotters::prelude::*;
        let kinds = self.series.len().max(1);
        let root = SVGBackend::new(path, (960, 3 * 200 * kinds as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let rows = root.split_evenly((kinds * 3, 1));
        for (i, (name, series)) in self.series.iter().enumerate() {
            let t: Vec<f64> =
                (0..BUCKETS).map(|b| (b as f64 + 0.5) * series.bucket_seconds).collect();
            let panels = [
                ("arrivals / s", &series.arrivals_per_second, BLUE),
                ("in service", &series.in_service, GREEN),
                ("queue wait p99 (s)", &series.wait_p99, RED),
            ];
            for (j, (label, values, color)) in panels.into_iter().enumerate() {
                let top = values.iter().copied().fold(0.0, f64::max).max(1e-3) * 1.1;
                let mut chart = ChartBuilder::on(&rows[i * 3 + j])
                    .caption(format!("{name}: {label}"), ("sans-serif", 16))
                    .margin(8)
                    .x_label_area_size(28)
                    .y_label_area_size(56)
                    .build_cartesian_2d(0.0..self.window_seconds, 0.0..top)?;
                chart.configure_mesh().x_desc("seconds into the window").draw()?;
                chart.draw_series(LineSeries::new(
                    t.iter().copied().zip(values.iter().copied()),
                    &color,
                ))?;
            }
        }
        root.present().with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(ready: f64, service: f64) -> Attempt {
        Attempt { ready, leased: ready, ended: ready + service, failed: false }
    }

    #[test]
    fn the_simulation_queues_what_the_servers_cannot_take() {
        // Four jobs of 1 s at once: one server makes them wait 0, 1, 2, 3 s; two, 0, 0, 1, 1.
        let at_once: Vec<(f64, f64)> = (0..4).map(|_| (0.0, 1.0)).collect();
        assert_eq!(simulate(&at_once, 1, 1.0), 3.0);
        assert_eq!(simulate(&at_once, 2, 1.0), 1.0);
        assert_eq!(simulate(&at_once, 4, 1.0), 0.0);
        // Spaced out by their service time, one server suffices.
        let spaced: Vec<(f64, f64)> = (0..4).map(|i| (f64::from(i), 1.0)).collect();
        assert_eq!(simulate(&spaced, 1, 1.0), 0.0);
    }

    #[test]
    fn the_recommendation_is_the_least_concurrency_meeting_the_objective() {
        let attempts: Vec<Attempt> = (0..10).map(|_| attempt(0.0, 1.0)).collect();
        let objective = Objective { wait: 1.5, quantile: 1.0, headroom: 0.0 };
        // Ten at once, 1 s each: 5 servers → waits up to 1 s; 4 → up to 2 s.
        assert_eq!(recommend(&attempts, 0.0, objective, 1), (5, 1.0));
        // 0.6 s of dispatch latency leaves 0.9 s: ten servers.
        assert_eq!(recommend(&attempts, 0.6, objective, 1).0, 10);
        // Never below the least it is given (the stable concurrency).
        assert_eq!(recommend(&attempts, 0.0, objective, 7), (7, 1.0));
        // With 50% headroom the jobs count as 1.5 s: five servers still meet 1.5 s ...
        let roomy = Objective { headroom: 0.5, ..objective };
        assert_eq!(recommend(&attempts, 0.0, roomy, 1), (5, 1.5));
        // ... and with 60%, 1.6 s jobs: any wait is too long, so one server each.
        let roomier = Objective { headroom: 0.6, ..objective };
        assert_eq!(recommend(&attempts, 0.0, roomier, 1), (10, 0.0));
    }

    #[test]
    fn figures_follow_littles_law_and_find_the_peak() {
        // One job a second for 100 s, 2 s each: 2 in service on average and at the peak.
        let kind = Kind {
            arrivals: (0..100).map(f64::from).collect(),
            attempts: (0..100).map(|i| attempt(f64::from(i), 2.0)).collect(),
        };
        let (report, series) = figures("k", &kind, 100.0, None);
        assert!((report.arrival_rate - 1.0).abs() < 1e-9);
        assert!((report.in_service_mean - 2.0).abs() < 1e-9);
        assert_eq!(report.in_service_peak, 2);
        assert_eq!(report.service_seconds.p99, 2.0);
        let middle = series.in_service[BUCKETS / 2];
        assert!((middle - 2.0).abs() < 1e-6, "{middle}");
    }
}
