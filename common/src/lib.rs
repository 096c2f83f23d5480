//! What jobfold's binaries and tests share.
//!
//! # Layout
//! - [`MIGRATOR`]: the schema in `migrations/`, embedded at build time. Services run it at
//!   start; sqlx takes a Postgres advisory lock so concurrent starts apply it once.

/// Every migration under `migrations/`, embedded in the binary.
///
/// Run it with `MIGRATOR.run(&pool).await`: it is idempotent and serialised across
/// processes by sqlx's migration lock.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
