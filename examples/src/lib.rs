//! The design's three jobs, as handlers a processor registers by kind:
//!
//! - [`index`]: `index-document` tokenizes a document and writes its term frequencies;
//! - [`summarize`]: `summarize-conversation` asks a model server (any OpenAI-compatible
//!   chat completions endpoint) for a summary, with the job's idempotency key;
//! - [`audio`]: `convert-audio` runs `sox` as a subprocess, writes the converted file
//!   atomically and commits its path and checksum.
//!
//! Each writes one business table, only over an older version of the same document, in the
//! completion transaction; the tables come with migrations of their own ([`MIGRATOR`]).
//! A fourth, [`noop`], is the trivial job benchmarks run: it does nothing and writes nothing.
//! `examples/python/worker.py` is a handler in Python over the HTTP protocol.
//!
//! The binary `jobfold-examples` is a processor running the four.

pub mod audio;
pub mod index;
pub mod noop;
pub mod summarize;

use jobfold_processor::handler::Committed;

/// The examples' tables (versions from 100001), after jobfold's own.
pub static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate::Migrator { ignore_missing: true, ..sqlx::migrate!("./migrations") };

/// Applies jobfold's migrations, then the examples'.
///
/// # Errors
/// A migration failed.
pub async fn migrate(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    jobfold_common::MIGRATOR.run(pool).await?;
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// After a conditional write (`... WHERE version <= EXCLUDED.version`): [`Committed::Applied`]
/// if it wrote a row, else [`Committed::Stale`] with the newer version the table holds, as
/// `newer` (a look-up, run only then) reads it.
///
/// # Errors
/// The look-up failed.
pub async fn applied_or_stale(
    written: u64,
    newer: impl std::future::Future<Output = Result<i64, sqlx::Error>>,
) -> Result<Committed, sqlx::Error> {
    if written > 0 {
        return Ok(Committed::Applied);
    }
    Ok(Committed::Stale { newer_version: newer.await? })
}
