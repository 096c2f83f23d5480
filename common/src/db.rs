//! Postgres: connection pools and the embedded migrations.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::Config;

/// Every migration under `migrations/`, embedded in the binary.
///
/// Run it with `MIGRATOR.run(&pool).await`: it is idempotent and serialised across
/// processes by sqlx's migration lock, so every service runs it at start.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// A pool of at most `max` connections to the configured database.
///
/// # Errors
/// The URL does not parse or the database cannot be reached.
pub async fn connect(config: &Config, max: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = config.database_url.expose().parse()?;
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
}

/// Connects and applies pending migrations.
///
/// # Errors
/// The database cannot be reached or a migration fails.
pub async fn connect_and_migrate(config: &Config, max: u32) -> anyhow::Result<PgPool> {
    let pool = connect(config, max).await?;
    MIGRATOR.run(&pool).await?;
    Ok(pool)
}
