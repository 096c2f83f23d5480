//! Analytics replay of the job event log: read it from Kafka or Postgres, fold it with the
//! schemas crate's [`fold`](jobfold_schemas::fold), and summarise, verify or export it.
//!
//! - **Kafka**: the events topic from its earliest offsets (or the first offsets at or after
//!   a timestamp) up to the high watermarks seen at start. Partitions are *assigned*, not
//!   subscribed: the reader joins no consumer group, commits nothing and disturbs no
//!   processor group.
//! - **Postgres**: `job_events` in log order (`seq`), in keyset pages.
//!
//! Duplicates — the same event delivered twice, as Kafka may after a relay crash — are
//! skipped exactly as the processor skips them: by event id. An event whose stream version
//! the job already has is a duplicate if its id matches the event applied there, and a
//! conflict (reported) if not.
//!
//! Memory is bounded by what is *unfinished* at any point of the log, not by its length:
//! a job that reaches a final state (succeeded, superseded, cancelled) is summarised,
//! verified and forgotten, keeping only its id in a bounded window that catches late
//! duplicates. Exports stream to disk (Parquet in row groups of [`ROW_GROUP`] rows).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use arrow_array::builder::{
    Int32Builder, Int64Builder, StringBuilder, TimestampMillisecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, TimeUnit};
use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use jobfold_common::config::Config;
use jobfold_schemas::{Decoder, JobEvent, JobState, Payload, Status};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sqlx::PgPool;
use uuid::Uuid;

/// Rows per Parquet row group (and per Arrow batch written).
pub const ROW_GROUP: usize = 65_536;
/// Events read from Postgres per page.
const PAGE: i64 = 5_000;
/// Finished jobs whose id is kept to recognise a late duplicate of their events.
pub const DEFAULT_DEDUPE_WINDOW: usize = 100_000;
/// Jobs compared with the projection per query.
const VERIFY_BATCH: usize = 500;
/// Differences printed in full (all are counted).
const SHOWN_DIFFERENCES: usize = 50;

/// Where the log is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Kafka,
    Postgres,
}

/// What the export writes, one row per ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    Events,
    Jobs,
}

/// The export file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    JsonLines,
    Parquet,
}

impl Format {
    /// `.parquet` → Parquet; anything else → JSON Lines.
    pub fn from_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("parquet") => Self::Parquet,
            _ => Self::JsonLines,
        }
    }
}

/// An export to write while replaying.
#[derive(Debug, Clone)]
pub struct Export {
    pub path: PathBuf,
    pub format: Format,
    pub rows: Rows,
}

/// What to replay and what to do with it.
#[derive(Debug, Clone)]
pub struct Options {
    pub source: Source,
    /// Only events at or after this time (Kafka: by message timestamp; Postgres: by
    /// `occurred_at`). Jobs that started earlier are counted as partial and not folded.
    pub since: Option<DateTime<Utc>>,
    /// Compare the folded jobs with the `jobs` projection.
    pub verify: bool,
    pub export: Option<Export>,
    /// Draw a progress bar on stderr (only where stderr is a terminal).
    pub progress: bool,
    pub dedupe_window: usize,
}

impl Options {
    /// A plain replay of the whole log from `source`: no verify, no export, no progress bar.
    pub fn new(source: Source) -> Self {
        Self {
            source,
            since: None,
            verify: false,
            export: None,
            progress: false,
            dedupe_window: DEFAULT_DEDUPE_WINDOW,
        }
    }
}

/// Where an event was read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Position {
    pub partition: Option<i32>,
    pub offset: Option<i64>,
    pub seq: Option<i64>,
}

/// One job as the log defines it, for the summary and the `--jobs` export.
#[derive(Debug, Clone)]
pub struct JobSummary {
    pub job_id: Uuid,
    pub document_id: String,
    pub job_kind: String,
    pub input_version: i64,
    pub status: Status,
    pub attempt: i32,
    pub max_attempts: i32,
    pub generation: i64,
    pub events: i32,
    pub accepted_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Milliseconds spent queued, leased and waiting to retry (up to the last event).
    pub queued_ms: i64,
    pub leased_ms: i64,
    pub retry_wait_ms: i64,
    pub last_error: Option<String>,
    pub quarantine_reason: Option<String>,
    pub superseded_by: Option<i64>,
}

/// What a replay found.
#[derive(Debug, Default)]
pub struct Report {
    pub source: Option<Source>,
    /// Events read, duplicates included.
    pub events: u64,
    /// Events skipped because the same event id was applied before.
    pub duplicates: u64,
    /// Events of jobs whose start is not in the replayed range (before `--since`, or
    /// outside the duplicate window): not folded.
    pub partial_events: u64,
    pub undecodable: u64,
    /// Jobs folded from their first event.
    pub jobs: u64,
    pub partial_jobs: u64,
    pub states: BTreeMap<Status, u64>,
    /// Per state (and `accept_to_end`): p50, p90, p99, max in milliseconds, and how many.
    pub time_in_state: BTreeMap<&'static str, Percentiles>,
    /// Attempts taken by finished and quarantined jobs → how many jobs.
    pub attempts: BTreeMap<i32, u64>,
    pub elapsed: Duration,
    /// Events the fold refused, and conflicting duplicates.
    pub anomalies: Vec<String>,
    pub anomaly_count: u64,
    /// With `--verify`: every way the projection differs from the folded log.
    pub differences: Vec<String>,
    pub difference_count: u64,
    pub verified: Option<u64>,
    /// With `--verify`: jobs the log ends in a final state and the projection no longer has
    /// (deleted by `retention.jobs_after`).
    pub deleted_by_retention: u64,
    /// With `--verify --from kafka`: jobs with a delayed event (a scheduled job's
    /// `JobRequested`, a retry's `RetryDue`) that waits in the outbox for its time. It is not
    /// on Kafka yet, as the log is meant to be, so these jobs are not compared.
    pub waiting_for_their_time: u64,
}

/// A latency distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

impl Report {
    /// Whether verification found nothing wrong (no difference, no anomaly).
    pub fn is_clean(&self) -> bool {
        self.difference_count == 0 && self.anomaly_count == 0 && self.undecodable == 0
    }

    fn anomaly(&mut self, text: String) {
        self.anomaly_count += 1;
        if self.anomalies.len() < SHOWN_DIFFERENCES {
            self.anomalies.push(text);
        }
    }

    fn difference(&mut self, text: String) {
        self.difference_count += 1;
        if self.differences.len() < SHOWN_DIFFERENCES {
            self.differences.push(text);
        }
    }
}

/// A job being folded.
struct Tracked {
    state: JobState,
    /// Ids of the events applied, by stream version − 1 (duplicates are checked against them).
    event_ids: Vec<Uuid>,
    /// When the job entered its current status.
    entered: DateTime<Utc>,
    spent_ms: [i64; 3],
}

impl Tracked {
    fn summary(&self) -> JobSummary {
        let s = &self.state;
        JobSummary {
            job_id: s.job_id,
            document_id: s.document_id.clone(),
            job_kind: s.job_kind.clone(),
            input_version: s.input_version,
            status: s.status,
            attempt: s.attempt,
            max_attempts: s.max_attempts,
            generation: s.generation,
            events: s.stream_version,
            accepted_at: s.accepted_at,
            finished_at: s.finished_at,
            queued_ms: self.spent_ms[0],
            leased_ms: self.spent_ms[1],
            retry_wait_ms: self.spent_ms[2],
            last_error: s.last_failure.as_ref().map(|f| f.message.clone()),
            quarantine_reason: s.quarantine.as_ref().map(|q| q.reason.clone()),
            superseded_by: s.superseded_by,
        }
    }
}

fn slot(status: Status) -> Option<usize> {
    match status {
        Status::Queued => Some(0),
        Status::Leased => Some(1),
        Status::RetryWait => Some(2),
        _ => None,
    }
}

/// The fold over a stream of events, with bounded memory.
struct Folder {
    active: HashMap<Uuid, Tracked>,
    finished: HashSet<Uuid>,
    finished_order: VecDeque<Uuid>,
    window: usize,
    /// Jobs seen without their start (with `--since`); their events are not folded.
    partial: HashSet<Uuid>,
    since: bool,
    histograms: [Histogram<u64>; 4],
    report: Report,
}

const HISTOGRAM_NAMES: [&str; 4] = ["queued", "leased", "retry_wait", "accept_to_end"];

impl Folder {
    fn new(window: usize, since: bool) -> Self {
        let histogram = || Histogram::new(3).expect("3 significant figures are valid");
        Self {
            active: HashMap::new(),
            finished: HashSet::new(),
            finished_order: VecDeque::new(),
            window: window.max(1),
            partial: HashSet::new(),
            since,
            histograms: [histogram(), histogram(), histogram(), histogram()],
            report: Report::default(),
        }
    }

    /// Applies one event; returns whether it is new (not a duplicate) and the job it ended,
    /// if it ended one.
    fn apply(&mut self, event: &JobEvent) -> (bool, Option<Tracked>) {
        self.report.events += 1;
        let id = event.job_id;
        if let Some(tracked) = self.active.get_mut(&id) {
            let applied = tracked.state.stream_version;
            if event.stream_version <= applied {
                let index = usize::try_from(event.stream_version - 1).unwrap_or(usize::MAX);
                if tracked.event_ids.get(index) == Some(&event.event_id) {
                    self.report.duplicates += 1;
                } else {
                    self.report.anomaly(format!(
                        "job {id}: event {} at stream version {} conflicts with event {:?} applied there",
                        event.event_id,
                        event.stream_version,
                        tracked.event_ids.get(index)
                    ));
                }
                return (false, None);
            }
            let before = tracked.state.status;
            if let Err(e) = tracked.state.apply(event) {
                self.report.anomaly(e.to_string());
                return (false, None);
            }
            tracked.event_ids.push(event.event_id);
            if tracked.state.status != before {
                if let Some(i) = slot(before) {
                    tracked.spent_ms[i] +=
                        (event.occurred_at - tracked.entered).num_milliseconds().max(0);
                }
                tracked.entered = event.occurred_at;
            }
            if tracked.state.status.is_final() {
                let done = self.active.remove(&id).expect("present");
                self.remember_finished(id);
                return (true, Some(done));
            }
            return (true, None);
        }
        if self.finished.contains(&id) {
            self.report.duplicates += 1;
            return (false, None);
        }
        if self.partial.contains(&id) {
            self.report.partial_events += 1;
            return (true, None);
        }
        if event.stream_version == 1 && matches!(event.payload, Payload::JobRequested(_)) {
            match JobState::start(event) {
                Ok(state) => {
                    self.report.jobs += 1;
                    let tracked = Tracked {
                        entered: state.accepted_at,
                        state,
                        event_ids: vec![event.event_id],
                        spent_ms: [0; 3],
                    };
                    self.active.insert(id, tracked);
                }
                Err(e) => self.report.anomaly(e.to_string()),
            }
            return (true, None);
        }
        // Its start is not in the range: before --since, or a late duplicate of a job that
        // left the window (or a topic whose retention dropped the start).
        self.report.partial_events += 1;
        if self.since {
            self.report.partial_jobs += 1;
            self.partial.insert(id);
        } else {
            self.report.anomaly(format!(
                "job {id}: event {} (stream version {}) without the job's start: a duplicate older than the window of {} finished jobs, or the log lost its start",
                event.event_id, event.stream_version, self.window
            ));
        }
        (true, None)
    }

    fn remember_finished(&mut self, id: Uuid) {
        self.finished.insert(id);
        self.finished_order.push_back(id);
        while self.finished_order.len() > self.window {
            if let Some(old) = self.finished_order.pop_front() {
                self.finished.remove(&old);
            }
        }
    }

    /// Counts a job that ended (or, at the end, one still unfinished).
    fn account(&mut self, job: &JobSummary) {
        *self.report.states.entry(job.status).or_default() += 1;
        for (i, spent) in [job.queued_ms, job.leased_ms, job.retry_wait_ms].into_iter().enumerate()
        {
            if spent > 0 {
                let _ = self.histograms[i].record(u64::try_from(spent).unwrap_or(0));
            }
        }
        if let Some(finished) = job.finished_at {
            let took = (finished - job.accepted_at).num_milliseconds().max(0);
            let _ = self.histograms[3].record(u64::try_from(took).unwrap_or(0));
            *self.report.attempts.entry(job.attempt).or_default() += 1;
        }
    }

    fn percentiles(&mut self) {
        for (name, h) in HISTOGRAM_NAMES.iter().zip(&self.histograms) {
            if h.is_empty() {
                continue;
            }
            self.report.time_in_state.insert(
                name,
                Percentiles {
                    count: h.len(),
                    p50: h.value_at_quantile(0.50),
                    p90: h.value_at_quantile(0.90),
                    p99: h.value_at_quantile(0.99),
                    max: h.max(),
                },
            );
        }
    }
}

/// Reads raw event frames in batches from one of the sources.
pub(crate) enum Reader {
    Kafka {
        consumer: StreamConsumer,
        /// Partition → the offset to stop before (the high watermark at start).
        remaining: BTreeMap<i32, i64>,
    },
    Postgres {
        pool: PgPool,
        after: i64,
        since: Option<DateTime<Utc>>,
    },
}

impl Reader {
    /// Opens the source; returns the reader and an estimate of the events to read.
    pub(crate) async fn open(
        config: &Config,
        pool: &PgPool,
        source: Source,
        since: Option<DateTime<Utc>>,
    ) -> anyhow::Result<(Self, u64)> {
        match source {
            Source::Postgres => {
                let range = sqlx::query!(
                    "SELECT min(seq) AS first, max(seq) AS last FROM job_events \
                     WHERE $1::timestamptz IS NULL OR occurred_at >= $1",
                    since,
                )
                .fetch_one(pool)
                .await?;
                let (first, last) = (range.first, range.last);
                let estimate = match (first, last) {
                    (Some(a), Some(b)) => u64::try_from(b - a + 1).unwrap_or(0),
                    _ => 0,
                };
                let after = first.map_or(0, |f| f - 1);
                Ok((Self::Postgres { pool: pool.clone(), after, since }, estimate))
            }
            Source::Kafka => {
                let topic = config.topics.events.clone();
                let consumer: StreamConsumer = config
                    .kafka_client()
                    // A group id librdkafka wants for a consumer; the reader never joins it
                    // (partitions are assigned) and never commits.
                    .set("group.id", format!("jobfold-replay-{}", Uuid::new_v4().simple()))
                    .set("enable.auto.commit", "false")
                    .set("enable.auto.offset.store", "false")
                    .set("enable.partition.eof", "false")
                    // Bounded prefetch: memory stays flat however long the topic.
                    .set("queued.max.messages.kbytes", "16384")
                    .create()
                    .context("creating the Kafka reader")?;
                // Metadata, watermarks and offsets by time are blocking calls.
                tokio::task::spawn_blocking(move || Self::assign(consumer, &topic, since)).await?
            }
        }
    }

    fn assign(
        consumer: StreamConsumer,
        topic: &str,
        since: Option<DateTime<Utc>>,
    ) -> anyhow::Result<(Self, u64)> {
        let timeout = Duration::from_secs(30);
        let metadata = consumer
            .fetch_metadata(Some(topic), timeout)
            .with_context(|| format!("reading the metadata of {topic}"))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map(|t| t.partitions().iter().map(|p| p.id()).collect())
            .unwrap_or_default();
        anyhow::ensure!(
            !partitions.is_empty(),
            "topic {topic} does not exist or has no partitions"
        );
        let mut starts = TopicPartitionList::new();
        for p in &partitions {
            let offset = match since {
                None => Offset::Beginning,
                Some(t) => Offset::Offset(t.timestamp_millis()),
            };
            starts.add_partition_offset(topic, *p, offset)?;
        }
        if since.is_some() {
            starts =
                consumer.offsets_for_times(starts, timeout).context("finding offsets by time")?;
        }
        let mut remaining = BTreeMap::new();
        let mut assignment = TopicPartitionList::new();
        let mut estimate = 0u64;
        for p in partitions {
            let (low, high) = consumer.fetch_watermarks(topic, p, timeout)?;
            let start = match starts.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o.max(low),
                Some(Offset::End) => high,
                _ => low,
            };
            if start < high {
                remaining.insert(p, high);
                assignment.add_partition_offset(topic, p, Offset::Offset(start))?;
                estimate += u64::try_from(high - start).unwrap_or(0);
            }
        }
        consumer.assign(&assignment).context("assigning the partitions")?;
        Ok((Self::Kafka { consumer, remaining }, estimate))
    }

    /// The next batch of frames; `None` at the end.
    pub(crate) async fn next(&mut self) -> anyhow::Result<Option<Vec<(Position, Vec<u8>)>>> {
        match self {
            Self::Postgres { pool, after, since } => {
                let rows = sqlx::query!(
                    r#"
                    SELECT seq, body FROM job_events
                    WHERE seq > $1 AND ($2::timestamptz IS NULL OR occurred_at >= $2)
                    ORDER BY seq
                    LIMIT $3
                    "#,
                    *after,
                    *since,
                    PAGE,
                )
                .fetch_all(&*pool)
                .await?;
                let Some(last) = rows.last() else { return Ok(None) };
                *after = last.seq;
                Ok(Some(
                    rows.into_iter()
                        .map(|r| (Position { seq: Some(r.seq), ..Position::default() }, r.body))
                        .collect(),
                ))
            }
            Self::Kafka { consumer, remaining } => {
                if remaining.is_empty() {
                    return Ok(None);
                }
                let mut batch = Vec::new();
                while batch.len() < 1000 && !remaining.is_empty() {
                    let wait =
                        if batch.is_empty() { Duration::from_secs(30) } else { Duration::ZERO };
                    let message = match tokio::time::timeout(wait, consumer.recv()).await {
                        Ok(message) => message.context("reading the events topic")?,
                        Err(_) if batch.is_empty() => anyhow::bail!(
                            "no message for 30 s while partitions {:?} had more to read",
                            remaining.keys().collect::<Vec<_>>()
                        ),
                        Err(_) => break,
                    };
                    let partition = message.partition();
                    let Some(end) = remaining.get(&partition).copied() else { continue };
                    if message.offset() >= end {
                        remaining.remove(&partition);
                        continue;
                    }
                    if message.offset() + 1 >= end {
                        remaining.remove(&partition);
                    }
                    let position = Position {
                        partition: Some(partition),
                        offset: Some(message.offset()),
                        seq: None,
                    };
                    batch.push((position, message.payload().unwrap_or_default().to_vec()));
                }
                Ok(Some(batch))
            }
        }
    }
}

/// Replays the log as `options` say.
///
/// # Errors
/// A source or the export cannot be read or written. Differences and anomalies are not
/// errors: they are in the [`Report`].
pub async fn replay(
    config: &Config,
    pool: &PgPool,
    decoder: &Decoder<JobEvent>,
    options: &Options,
) -> anyhow::Result<Report> {
    let started = Instant::now();
    let (mut reader, estimate) = Reader::open(config, pool, options.source, options.since).await?;
    let bar = if options.progress {
        let bar = ProgressBar::with_draw_target(Some(estimate), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {msg} [{bar:40}] {human_pos}/{human_len} events, {per_sec}, eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_message(match options.source {
            Source::Kafka => "replaying from Kafka",
            Source::Postgres => "replaying from Postgres",
        });
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut writer = match &options.export {
        Some(export) => Some(Writer::create(export)?),
        None => None,
    };
    let mut folder = Folder::new(options.dedupe_window, options.since.is_some());
    let mut to_verify: Vec<JobSummary> = Vec::new();
    while let Some(batch) = reader.next().await? {
        bar.inc(batch.len() as u64);
        for (position, frame) in batch {
            let event = match decoder.decode(&frame).await {
                Ok(event) => event,
                Err(e) => {
                    folder.report.events += 1;
                    folder.report.undecodable += 1;
                    folder.report.anomaly(format!("undecodable event at {position:?}: {e}"));
                    continue;
                }
            };
            let (new, ended) = folder.apply(&event);
            if new
                && let Some(w) = writer.as_mut()
                && w.rows == Rows::Events
            {
                w.event(position, &event)?;
            }
            if let Some(done) = ended {
                let summary = done.summary();
                let queue = options.verify.then_some(&mut to_verify);
                finish_job(&mut folder, &mut writer, queue, summary)?;
                if options.verify && to_verify.len() >= VERIFY_BATCH {
                    verify(pool, options.source, &mut to_verify, &mut folder.report).await?;
                }
            }
        }
    }
    // What is still unfinished at the end of the log.
    let open: Vec<JobSummary> = folder.active.values().map(Tracked::summary).collect();
    folder.active.clear();
    for summary in open {
        let queue = options.verify.then_some(&mut to_verify);
        finish_job(&mut folder, &mut writer, queue, summary)?;
        if options.verify && to_verify.len() >= VERIFY_BATCH {
            verify(pool, options.source, &mut to_verify, &mut folder.report).await?;
        }
    }
    if options.verify {
        verify(pool, options.source, &mut to_verify, &mut folder.report).await?;
        verify_counts(pool, options, &mut folder.report).await?;
    }
    if let Some(writer) = writer {
        writer.finish()?;
    }
    bar.finish_and_clear();
    folder.percentiles();
    let mut report = folder.report;
    report.source = Some(options.source);
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Counts and exports a job that ended (or is still open at the end of the log), and
/// queues it for verification when `verify` is on.
fn finish_job(
    folder: &mut Folder,
    writer: &mut Option<Writer>,
    to_verify: Option<&mut Vec<JobSummary>>,
    summary: JobSummary,
) -> anyhow::Result<()> {
    folder.account(&summary);
    if let Some(w) = writer.as_mut()
        && w.rows == Rows::Jobs
    {
        w.job(&summary)?;
    }
    if let Some(queue) = to_verify {
        queue.push(summary);
    }
    Ok(())
}

/// The projection's view of a job, as far as the log defines it.
#[derive(Debug)]
struct ProjectionRow {
    job_id: Uuid,
    document_id: String,
    kind: String,
    input_version: i64,
    state: String,
    attempt: i32,
    max_attempts: i32,
    generation: i64,
    stream_version: i32,
    finished: bool,
}

/// Compares folded jobs with their projection rows; empties `jobs`.
async fn verify(
    pool: &PgPool,
    source: Source,
    jobs: &mut Vec<JobSummary>,
    report: &mut Report,
) -> anyhow::Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.job_id).collect();
    // Read from Kafka, a job whose delayed event is not due yet has less of its log there
    // than Postgres has: not a difference.
    let waiting: std::collections::HashSet<Uuid> = match source {
        Source::Postgres => std::collections::HashSet::new(),
        Source::Kafka => sqlx::query_scalar!(
            r#"
            SELECT DISTINCT e.job_id FROM outbox o JOIN job_events e USING (seq)
            WHERE o.published_at IS NULL AND o.available_at > now() AND e.job_id = ANY($1)
            "#,
            &ids,
        )
        .fetch_all(pool)
        .await?
        .into_iter()
        .collect(),
    };
    let rows = sqlx::query_as!(
        ProjectionRow,
        r#"
        SELECT job_id, document_id, kind, input_version, state::text AS "state!", attempt,
               max_attempts, generation, stream_version, finished_at IS NOT NULL AS "finished!"
        FROM jobs WHERE job_id = ANY($1)
        "#,
        &ids,
    )
    .fetch_all(pool)
    .await?;
    let mut rows: HashMap<Uuid, ProjectionRow> = rows.into_iter().map(|r| (r.job_id, r)).collect();
    for job in jobs.drain(..) {
        if waiting.contains(&job.job_id) {
            report.waiting_for_their_time += 1;
            continue;
        }
        *report.verified.get_or_insert(0) += 1;
        let Some(row) = rows.remove(&job.job_id) else {
            // Only retention deletes jobs, and only ended ones.
            if job.status.is_final() {
                report.deleted_by_retention += 1;
            } else {
                report.difference(format!("job {}: in the log, not in the projection", job.job_id));
            }
            continue;
        };
        let folded = [
            ("state", job.status.as_str().to_owned(), row.state.clone()),
            ("stream_version", job.events.to_string(), row.stream_version.to_string()),
            ("generation", job.generation.to_string(), row.generation.to_string()),
            ("attempt", job.attempt.to_string(), row.attempt.to_string()),
            ("max_attempts", job.max_attempts.to_string(), row.max_attempts.to_string()),
            ("input_version", job.input_version.to_string(), row.input_version.to_string()),
            ("document_id", job.document_id.clone(), row.document_id.clone()),
            ("kind", job.job_kind.clone(), row.kind.clone()),
            ("finished", job.finished_at.is_some().to_string(), row.finished.to_string()),
        ];
        for (field, log, projection) in folded {
            if log != projection {
                report.difference(format!(
                    "job {}: {field} is {projection} in the projection, {log} in the log",
                    job.job_id
                ));
            }
        }
    }
    Ok(())
}

/// Jobs of the projection that the log does not have (a full replay only).
async fn verify_counts(
    pool: &PgPool,
    options: &Options,
    report: &mut Report,
) -> anyhow::Result<()> {
    if options.since.is_some() {
        return Ok(());
    }
    let mut projection =
        sqlx::query_scalar!(r#"SELECT count(*) AS "count!" FROM jobs"#).fetch_one(pool).await?;
    if options.source == Source::Kafka {
        // Scheduled jobs whose JobRequested is not due yet: not on Kafka, as meant.
        let scheduled = sqlx::query_scalar!(
            r#"
            SELECT count(*) AS "count!" FROM outbox o JOIN job_events e USING (seq)
            WHERE o.published_at IS NULL AND o.available_at > now() AND e.stream_version = 1
            "#
        )
        .fetch_one(pool)
        .await?;
        report.waiting_for_their_time += u64::try_from(scheduled).unwrap_or(0);
        projection -= scheduled;
    }
    let folded = i64::try_from(report.jobs).unwrap_or(i64::MAX);
    if projection > folded {
        let (backlog, _) = jobfold_common::gauges::relay_backlog(pool).await?;
        let hint = match options.source {
            Source::Kafka if backlog > 0 => {
                format!(" ({backlog} outbox rows are not published yet: replay a drained system)")
            }
            _ => String::new(),
        };
        report.difference(format!(
            "the projection has {projection} jobs, the log starts {folded}{hint}"
        ));
    }
    Ok(())
}

/// The export being written.
struct Writer {
    rows: Rows,
    sink: Sink,
}

enum Sink {
    Json(std::io::BufWriter<std::fs::File>),
    Parquet(Box<ParquetSink>),
}

impl Writer {
    fn create(export: &Export) -> anyhow::Result<Self> {
        let file = std::fs::File::create(&export.path)
            .with_context(|| format!("creating {}", export.path.display()))?;
        let sink = match export.format {
            Format::JsonLines => Sink::Json(std::io::BufWriter::with_capacity(1 << 20, file)),
            Format::Parquet => Sink::Parquet(Box::new(ParquetSink::new(file, export.rows)?)),
        };
        Ok(Self { rows: export.rows, sink })
    }

    fn event(&mut self, position: Position, event: &JobEvent) -> anyhow::Result<()> {
        match &mut self.sink {
            Sink::Json(out) => {
                let mut row = event.to_json();
                if let Some(fields) = row.as_object_mut() {
                    fields.insert("partition".into(), position.partition.into());
                    fields.insert("offset".into(), position.offset.into());
                    fields.insert("seq".into(), position.seq.into());
                    fields.insert("type".into(), event.payload.kind().into());
                }
                serde_json::to_writer(&mut *out, &row)?;
                out.write_all(b"\n")?;
            }
            Sink::Parquet(sink) => sink.event(position, event)?,
        }
        Ok(())
    }

    fn job(&mut self, job: &JobSummary) -> anyhow::Result<()> {
        match &mut self.sink {
            Sink::Json(out) => {
                let row = serde_json::json!({
                    "job_id": job.job_id,
                    "document_id": job.document_id,
                    "job_kind": job.job_kind,
                    "input_version": job.input_version,
                    "status": job.status.as_str(),
                    "attempt": job.attempt,
                    "max_attempts": job.max_attempts,
                    "generation": job.generation,
                    "events": job.events,
                    "accepted_at": job.accepted_at,
                    "finished_at": job.finished_at,
                    "queued_ms": job.queued_ms,
                    "leased_ms": job.leased_ms,
                    "retry_wait_ms": job.retry_wait_ms,
                    "last_error": job.last_error,
                    "quarantine_reason": job.quarantine_reason,
                    "superseded_by": job.superseded_by,
                });
                serde_json::to_writer(&mut *out, &row)?;
                out.write_all(b"\n")?;
            }
            Sink::Parquet(sink) => sink.job(job)?,
        }
        Ok(())
    }

    fn finish(self) -> anyhow::Result<()> {
        match self.sink {
            Sink::Json(mut out) => out.flush()?,
            Sink::Parquet(sink) => sink.finish()?,
        }
        Ok(())
    }
}

/// Column builders for one Arrow batch, flushed to a Parquet row group every [`ROW_GROUP`]
/// rows.
struct ParquetSink {
    writer: parquet::arrow::ArrowWriter<std::fs::File>,
    schema: Arc<Schema>,
    strings: Vec<StringBuilder>,
    longs: Vec<Int64Builder>,
    ints: Vec<Int32Builder>,
    times: Vec<TimestampMillisecondBuilder>,
    rows: usize,
    kind: Rows,
}

/// The Parquet columns, in order: name, type, nullable.
fn columns(rows: Rows) -> Vec<(&'static str, DataType, bool)> {
    let time = DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()));
    match rows {
        Rows::Events => vec![
            ("event_id", DataType::Utf8, false),
            ("job_id", DataType::Utf8, false),
            ("document_id", DataType::Utf8, false),
            ("job_kind", DataType::Utf8, false),
            ("type", DataType::Utf8, false),
            ("producer", DataType::Utf8, false),
            ("payload", DataType::Utf8, false),
            ("traceparent", DataType::Utf8, true),
            ("input_version", DataType::Int64, false),
            ("offset", DataType::Int64, true),
            ("seq", DataType::Int64, true),
            ("stream_version", DataType::Int32, false),
            ("partition", DataType::Int32, true),
            ("occurred_at", time, false),
        ],
        Rows::Jobs => vec![
            ("job_id", DataType::Utf8, false),
            ("document_id", DataType::Utf8, false),
            ("job_kind", DataType::Utf8, false),
            ("status", DataType::Utf8, false),
            ("last_error", DataType::Utf8, true),
            ("quarantine_reason", DataType::Utf8, true),
            ("input_version", DataType::Int64, false),
            ("generation", DataType::Int64, false),
            ("queued_ms", DataType::Int64, false),
            ("leased_ms", DataType::Int64, false),
            ("retry_wait_ms", DataType::Int64, false),
            ("superseded_by", DataType::Int64, true),
            ("attempt", DataType::Int32, false),
            ("max_attempts", DataType::Int32, false),
            ("events", DataType::Int32, false),
            ("accepted_at", time.clone(), false),
            ("finished_at", time, true),
        ],
    }
}

impl ParquetSink {
    fn new(file: std::fs::File, kind: Rows) -> anyhow::Result<Self> {
        let columns = columns(kind);
        let schema = Arc::new(Schema::new(
            columns
                .iter()
                .map(|(name, ty, null)| Field::new(*name, ty.clone(), *null))
                .collect::<Vec<_>>(),
        ));
        let count = |t: fn(&DataType) -> bool| columns.iter().filter(|(_, ty, _)| t(ty)).count();
        let properties = parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .set_max_row_group_row_count(Some(ROW_GROUP))
            .build();
        let writer =
            parquet::arrow::ArrowWriter::try_new(file, Arc::clone(&schema), Some(properties))?;
        Ok(Self {
            writer,
            schema,
            strings: (0..count(|t| *t == DataType::Utf8)).map(|_| StringBuilder::new()).collect(),
            longs: (0..count(|t| *t == DataType::Int64)).map(|_| Int64Builder::new()).collect(),
            ints: (0..count(|t| *t == DataType::Int32)).map(|_| Int32Builder::new()).collect(),
            times: (0..count(|t| matches!(t, DataType::Timestamp(..))))
                .map(|_| TimestampMillisecondBuilder::new().with_timezone("UTC"))
                .collect(),
            rows: 0,
            kind,
        })
    }

    fn event(&mut self, position: Position, event: &JobEvent) -> anyhow::Result<()> {
        let payload = event.to_json()["payload"].to_string();
        let strings = [
            Some(event.event_id.to_string()),
            Some(event.job_id.to_string()),
            Some(event.document_id.clone()),
            Some(event.job_kind.clone()),
            Some(event.payload.kind().to_owned()),
            Some(event.producer.clone()),
            Some(payload),
            event.trace.as_ref().map(|t| t.traceparent.clone()),
        ];
        let longs = [Some(event.input_version), position.offset, position.seq];
        let ints = [Some(event.stream_version), position.partition];
        let times = [Some(event.occurred_at.timestamp_millis())];
        self.row(&strings, &longs, &ints, &times)
    }

    fn job(&mut self, job: &JobSummary) -> anyhow::Result<()> {
        let strings = [
            Some(job.job_id.to_string()),
            Some(job.document_id.clone()),
            Some(job.job_kind.clone()),
            Some(job.status.as_str().to_owned()),
            job.last_error.clone(),
            job.quarantine_reason.clone(),
        ];
        let longs = [
            Some(job.input_version),
            Some(job.generation),
            Some(job.queued_ms),
            Some(job.leased_ms),
            Some(job.retry_wait_ms),
            job.superseded_by,
        ];
        let ints = [Some(job.attempt), Some(job.max_attempts), Some(job.events)];
        let times = [
            Some(job.accepted_at.timestamp_millis()),
            job.finished_at.map(|t| t.timestamp_millis()),
        ];
        self.row(&strings, &longs, &ints, &times)
    }

    fn row(
        &mut self,
        strings: &[Option<String>],
        longs: &[Option<i64>],
        ints: &[Option<i32>],
        times: &[Option<i64>],
    ) -> anyhow::Result<()> {
        debug_assert_eq!(strings.len(), self.strings.len(), "{:?}", self.kind);
        for (builder, value) in self.strings.iter_mut().zip(strings) {
            builder.append_option(value.as_deref());
        }
        for (builder, value) in self.longs.iter_mut().zip(longs) {
            builder.append_option(*value);
        }
        for (builder, value) in self.ints.iter_mut().zip(ints) {
            builder.append_option(*value);
        }
        for (builder, value) in self.times.iter_mut().zip(times) {
            builder.append_option(*value);
        }
        self.rows += 1;
        if self.rows >= ROW_GROUP {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the rows built so far as one batch, columns in schema order.
    fn flush(&mut self) -> anyhow::Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let (mut s, mut l, mut i, mut t) = (0, 0, 0, 0);
        let arrays: Vec<ArrayRef> = self
            .schema
            .fields()
            .iter()
            .map(|field| -> ArrayRef {
                match field.data_type() {
                    DataType::Utf8 => {
                        s += 1;
                        Arc::new(self.strings[s - 1].finish())
                    }
                    DataType::Int64 => {
                        l += 1;
                        Arc::new(self.longs[l - 1].finish())
                    }
                    DataType::Int32 => {
                        i += 1;
                        Arc::new(self.ints[i - 1].finish())
                    }
                    _ => {
                        t += 1;
                        Arc::new(self.times[t - 1].finish())
                    }
                }
            })
            .collect();
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), arrays)?;
        self.writer.write(&batch)?;
        self.writer.flush()?;
        self.rows = 0;
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.flush()?;
        self.writer.close()?;
        Ok(())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match self.source {
            Some(Source::Kafka) => "Kafka",
            Some(Source::Postgres) => "Postgres",
            None => "?",
        };
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "replayed {} events from {source} in {:.1} s ({:.0} events/s)",
            self.events,
            secs,
            self.events as f64 / secs
        )?;
        writeln!(
            f,
            "  duplicates skipped {}, undecodable {}, events of partial jobs {}",
            self.duplicates, self.undecodable, self.partial_events
        )?;
        writeln!(
            f,
            "jobs folded {} (partial, started before the range: {})",
            self.jobs, self.partial_jobs
        )?;
        for (status, count) in &self.states {
            writeln!(f, "  {:<12} {count:>10}", status.as_str())?;
        }
        if !self.time_in_state.is_empty() {
            writeln!(
                f,
                "time in state (ms)       jobs        p50        p90        p99        max"
            )?;
            for (name, p) in &self.time_in_state {
                writeln!(
                    f,
                    "  {name:<16} {:>10} {:>10} {:>10} {:>10} {:>10}",
                    p.count, p.p50, p.p90, p.p99, p.max
                )?;
            }
        }
        if !self.attempts.is_empty() {
            let spread: Vec<String> =
                self.attempts.iter().map(|(a, n)| format!("{a}: {n}")).collect();
            writeln!(f, "attempts per ended job   {}", spread.join(", "))?;
        }
        for anomaly in &self.anomalies {
            writeln!(f, "anomaly: {anomaly}")?;
        }
        if self.anomaly_count > self.anomalies.len() as u64 {
            writeln!(f, "... {} anomalies in all", self.anomaly_count)?;
        }
        if let Some(verified) = self.verified {
            for difference in &self.differences {
                writeln!(f, "difference: {difference}")?;
            }
            if self.deleted_by_retention > 0 {
                writeln!(
                    f,
                    "verify: {} ended jobs of the log were deleted by retention",
                    self.deleted_by_retention
                )?;
            }
            if self.waiting_for_their_time > 0 {
                writeln!(
                    f,
                    "verify: {} jobs have a delayed event (a scheduled run, a retry) waiting for \
                     its time, not on Kafka yet: not compared",
                    self.waiting_for_their_time
                )?;
            }
            if self.is_clean() {
                writeln!(f, "verify: the projection matches the folded log ({verified} jobs)")?;
            } else {
                writeln!(
                    f,
                    "verify: {} differences, {} anomalies ({verified} jobs compared)",
                    self.difference_count, self.anomaly_count
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use jobfold_schemas::event::{JobLeased, JobRequested, JobSucceeded};

    use super::*;

    fn event(job_id: Uuid, stream_version: i32, at_ms: i64) -> JobEvent {
        let payload = match stream_version {
            1 => Payload::JobRequested(JobRequested {
                input: "{}".into(),
                idempotency_key: None,
                max_attempts: 3,
                deadline: None,
                run_at: None,
            }),
            2 => Payload::JobLeased(JobLeased {
                generation: 1,
                attempt: 1,
                lease_owner: "w".into(),
                lease_until: DateTime::from_timestamp_millis(at_ms + 30_000).unwrap(),
                leased_at: DateTime::from_timestamp_millis(at_ms),
                dispatch_event_id: Uuid::now_v7(),
            }),
            _ => Payload::JobSucceeded(JobSucceeded {
                generation: 1,
                attempt: 1,
                result: "{}".into(),
                lease: None,
            }),
        };
        JobEvent {
            event_id: Uuid::now_v7(),
            job_id,
            document_id: "d".into(),
            job_kind: "k".into(),
            input_version: 1,
            stream_version,
            occurred_at: DateTime::from_timestamp_millis(at_ms).unwrap(),
            trace: None,
            producer: "test".into(),
            payload,
        }
    }

    #[test]
    fn duplicates_are_skipped_by_event_id_before_and_after_the_job_ends() {
        let mut folder = Folder::new(10, false);
        let job = Uuid::now_v7();
        let log: Vec<JobEvent> = (1..=3).map(|v| event(job, v, 1_000 * i64::from(v))).collect();
        assert!(folder.apply(&log[0]).0);
        assert!(!folder.apply(&log[0]).0, "same id, same version: duplicate");
        assert!(folder.apply(&log[1]).1.is_none());
        let (new, ended) = folder.apply(&log[2]);
        let ended = ended.expect("succeeded ends the job");
        assert!(new);
        assert_eq!(ended.state.status, Status::Succeeded);
        assert_eq!(ended.spent_ms, [1_000, 1_000, 0], "queued 1 s, leased 1 s");
        assert!(!folder.apply(&log[1]).0, "a late duplicate of a finished job");
        assert_eq!((folder.report.duplicates, folder.report.anomaly_count), (2, 0));
        assert!(folder.active.is_empty(), "finished jobs are forgotten");
    }

    #[test]
    fn another_event_at_an_applied_stream_version_is_an_anomaly() {
        let mut folder = Folder::new(10, false);
        let job = Uuid::now_v7();
        folder.apply(&event(job, 1, 0));
        folder.apply(&event(job, 2, 1));
        let impostor = event(job, 2, 2);
        assert!(!folder.apply(&impostor).0);
        assert_eq!((folder.report.duplicates, folder.report.anomaly_count), (0, 1));
        assert!(folder.report.anomalies[0].contains("conflicts"), "{:?}", folder.report.anomalies);
    }

    #[test]
    fn jobs_started_before_since_are_partial_and_the_window_is_bounded() {
        let mut folder = Folder::new(2, true);
        let partial = Uuid::now_v7();
        folder.apply(&event(partial, 2, 0));
        folder.apply(&event(partial, 3, 1));
        assert_eq!((folder.report.partial_jobs, folder.report.partial_events), (1, 2));
        assert_eq!(folder.report.anomaly_count, 0);
        for _ in 0..5 {
            let job = Uuid::now_v7();
            for v in 1..=3 {
                folder.apply(&event(job, v, 0));
            }
        }
        assert_eq!(folder.finished.len(), 2, "only the window of finished ids is kept");
        assert_eq!(folder.finished_order.len(), 2);
    }
}
