//! The history checker: after a run, what Postgres and the events topic hold must show no
//! lost job and no duplicate effect, whatever happened during the run.
//!
//! - every acknowledged job exists (HTTP and Rust API: by job id; intake: by request id);
//! - every job ended succeeded, quarantined (with a reason) or superseded: none is stuck;
//! - exactly one business write per succeeded (job, input_version), and none for a job that
//!   did not succeed at that version — counted in `index_writes`, which has no unique
//!   constraint, so a duplicate effect would show;
//! - `document_index` holds the highest succeeded input version of every document;
//! - accepted = succeeded + quarantined + superseded;
//! - the event log, folded by the schemas crate's fold, from Postgres and from Kafka, gives
//!   exactly the `jobs` projection.

use std::collections::BTreeMap;
use std::fmt;

use jobfold_common::config::Config;
use jobfold_processor::analytics::{self, Options, Source};
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
) -> anyhow::Result<History> {
    let mut h = History::default();
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
        "SELECT job_id::text || ' (' || state || ')' FROM jobs WHERE state NOT IN ('succeeded', 'quarantined', 'superseded')",
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
        "SELECT j.job_id::text FROM jobs j WHERE j.state = 'succeeded' AND NOT EXISTS \
         (SELECT 1 FROM index_writes w WHERE w.job_id = j.job_id AND w.input_version = j.input_version)",
    )
    .await;
    finding(
        missing.is_empty(),
        format!("{} succeeded jobs have no business write: {}", missing.len(), shown(&missing)),
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

    // The index holds each document's highest succeeded version.
    let wrong_index = ids(
        pool,
        "WITH best AS (SELECT document_id, max(input_version) AS v FROM jobs WHERE state = 'succeeded' GROUP BY 1) \
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

    // accepted = succeeded + quarantined + superseded.
    h.states = jobfold_common::gauges::totals(pool).await?.into_iter().collect();
    h.accepted = h.states.values().sum();
    let ended: i64 = ["succeeded", "quarantined", "superseded"]
        .iter()
        .map(|s| h.states.get(*s).copied().unwrap_or(0))
        .sum();
    finding(
        h.accepted == ended,
        format!("accepted {} != succeeded + quarantined + superseded {ended}", h.accepted),
    );
    // language=PostgreSQL
    h.business_writes =
        sqlx::query_scalar("SELECT count(*) FROM index_writes").fetch_one(pool).await?;

    // fold(log) = projection, from both sources.
    let decoder = Decoder::<JobEvent>::new(jobfold_schemas::codec::registry_settings(
        &config.schema_registry_url,
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
