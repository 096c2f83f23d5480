//! The fault tests' handler: the example `index-document` with knobs to fail and slow it,
//! and an audit of every business write it commits (`index_writes`, the oracle of the
//! exactly-once checks). Test-only: nothing that ships honours these knobs.
//!
//! The input may carry `"simulate"`: `{"fail_attempts": 2}` fails the first two attempts
//! retryably, `{"permanent": true}` fails permanently, `{"sleep_ms": 200}` makes each attempt
//! take that long (ended early by the cancellation token), `{"hang_ms": 60000}` takes that
//! long ignoring the token, `{"panic": true}` panics, `{"output_bytes": 20000}` returns a
//! result of about that size, `{"permanent_until_replayed": true}` fails permanently until an
//! operator replays the job (its generation then runs ahead of its attempt),
//! `{"abort": true}` aborts the whole process (a native library's crash, an OOM kill),
//! `{"commit_panic": true}` panics in the business write, `{"cost_panic": true}` panics in
//! `cost` (asked for only where the kind has a `cost_per_minute`), `{"retry_after_secs": N}` asks
//! for an N-second wait with each failing attempt (`fail_attempts`), and
//! `{"snooze_until_ms": T}` snoozes the job for 200 ms at a time until T (Unix ms), and
//! `{"meet": {"dir": D, "of": N}}` makes each attempt wait until N runs with the same `dir`
//! are running (each leaves a file there), failing retryably if they have not met within
//! 30 s — runs that cannot happen side by side never meet.

use std::time::Duration;

use jobfold_examples::index::{self, IndexDocument};
use jobfold_processor::handler::{Committed, Handler, HandlerError, Handlers, JobContext};
use serde_json::Value;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

/// The tests' own tables (versions from 200001).
pub static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate::Migrator { ignore_missing: true, ..sqlx::migrate!("./migrations") };

/// jobfold's migrations, the examples' and the tests'.
///
/// # Errors
/// A migration failed.
pub async fn migrate(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    jobfold_examples::migrate(pool).await?;
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// The kind the test handler runs.
pub const KIND: &str = index::KIND;

/// The handlers of `jobfold-test-processor`: [`Simulated`] as `index-document`.
pub fn handlers() -> Handlers {
    Handlers::new().with(KIND, Simulated)
}

/// `index-document` with the `simulate` knobs, recording each write in `index_writes`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Simulated;

/// Appends one row to `index_writes`, the audit of business writes: it has no unique key, so
/// a write committed twice shows as two rows. Call it inside the write's transaction.
///
/// # Errors
/// The statement failed; the transaction should be rolled back.
pub async fn record_write(tx: &mut PgConnection, job: &JobContext) -> Result<(), sqlx::Error> {
    // language=PostgreSQL
    sqlx::query(
        "INSERT INTO index_writes (job_id, document_id, input_version, generation) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(job.job_id)
    .bind(&job.document_id)
    .bind(job.input_version)
    .bind(job.generation)
    .execute(tx)
    .await?;
    Ok(())
}

/// The `meet` knob: leaves this run's file in `dir` and waits until `of` runs have left
/// theirs (the files stay: a later attempt of a run that met meets again at once).
async fn meet_the_others(meet: &Value, job: &JobContext) -> Result<(), HandlerError> {
    let (Some(dir), Some(of)) =
        (meet.get("dir").and_then(Value::as_str), meet.get("of").and_then(Value::as_u64))
    else {
        return Err(HandlerError::permanent("meet needs a dir and an of"));
    };
    let dir = std::path::Path::new(dir);
    let fail = |e: std::io::Error| HandlerError::retryable(format!("meet: {e}"));
    std::fs::create_dir_all(dir).map_err(fail)?;
    std::fs::write(dir.join(job.job_id.to_string()), b"").map_err(fail)?;
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let here = std::fs::read_dir(dir).map_err(fail)?.count() as u64;
        if here >= of {
            return Ok(());
        }
        if std::time::Instant::now() >= until {
            return Err(HandlerError::retryable(format!(
                "met {} of {of} runs: the others did not run beside it",
                here
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Handler for Simulated {
    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        let simulate = job.input.get("simulate").cloned().unwrap_or(Value::Null);
        if let Some(ms) = simulate.get("hang_ms").and_then(Value::as_u64) {
            // Deaf to the token: only the run time-out (which drops the run) ends it early.
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if simulate.get("panic").and_then(Value::as_bool) == Some(true) {
            panic!("simulated panic on attempt {}", job.attempt);
        }
        if simulate.get("abort").and_then(Value::as_bool) == Some(true) {
            eprintln!("simulated crash: job {} aborts its process", job.job_id);
            std::process::abort();
        }
        if let Some(until) = simulate.get("snooze_until_ms").and_then(Value::as_i64)
            && chrono::Utc::now().timestamp_millis() < until
        {
            return Err(HandlerError::snooze(
                "simulated: not ready yet",
                Duration::from_millis(200),
            ));
        }
        if let Some(meet) = simulate.get("meet") {
            meet_the_others(meet, job).await?;
        }
        if let Some(ms) = simulate.get("sleep_ms").and_then(Value::as_u64) {
            tokio::select! {
                _ = cancel.cancelled() => return Err(HandlerError::retryable("cancelled: the lease was lost")),
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
            }
        }
        if simulate.get("permanent").and_then(Value::as_bool) == Some(true) {
            return Err(HandlerError::permanent("simulated permanent failure"));
        }
        let replayed = job.generation > i64::from(job.attempt);
        if simulate.get("permanent_until_replayed").and_then(Value::as_bool) == Some(true)
            && !replayed
        {
            return Err(HandlerError::permanent("the upstream refused it (until replayed)"));
        }
        let fail_attempts = simulate.get("fail_attempts").and_then(Value::as_i64).unwrap_or(0);
        if i64::from(job.attempt) <= fail_attempts {
            let error = HandlerError::retryable(format!(
                "simulated transient failure (attempt {} of {fail_attempts} failing)",
                job.attempt
            ));
            return Err(match simulate.get("retry_after_secs").and_then(Value::as_u64) {
                Some(secs) => error.retry_after(Duration::from_secs(secs)),
                None => error,
            });
        }
        let mut output = IndexDocument.run(job, cancel).await?;
        if let Some(bytes) = simulate.get("output_bytes").and_then(Value::as_u64) {
            output["padding"] = Value::String("x".repeat(bytes as usize));
        }
        Ok(output)
    }

    fn cost(&self, input: &Value) -> u64 {
        let simulate = input.get("simulate");
        if simulate.and_then(|s| s.get("cost_panic")).and_then(Value::as_bool) == Some(true) {
            panic!("simulated panic in the cost of an input");
        }
        1
    }

    async fn commit(
        &self,
        tx: &mut PgConnection,
        job: &JobContext,
        output: &Value,
    ) -> Result<Committed, sqlx::Error> {
        let simulate = job.input.get("simulate");
        if simulate.and_then(|s| s.get("commit_panic")).and_then(Value::as_bool) == Some(true) {
            panic!("simulated panic in the business write of attempt {}", job.attempt);
        }
        let committed = IndexDocument.commit(tx, job, output).await?;
        if committed == Committed::Applied {
            record_write(tx, job).await?;
        }
        Ok(committed)
    }
}

/// A processor with [`handlers`] in this process, as `jobfold-test-processor` runs it.
///
/// # Errors
/// As [`jobfold_processor::Processor::run`].
pub async fn run(
    config: jobfold_common::config::Config,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    jobfold_processor::Processor::builder(config).handlers(handlers()).run(shutdown).await
}
