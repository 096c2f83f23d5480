//! Postgres: connection pools and the embedded migrations.

use std::time::Duration;

use anyhow::Context;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::Config;

/// Every migration under `migrations/`, embedded in the binary.
///
/// Run it with `MIGRATOR.run(&pool).await`: it is idempotent and serialised across
/// processes by sqlx's migration lock, so every service runs it at start.
///
/// Handlers' business tables come with migrations of their own in the same database (the
/// examples' start at version 100001): each migrator ignores the versions it does not hold.
/// Run this one first.
pub static MIGRATOR: sqlx::migrate::Migrator =
    sqlx::migrate::Migrator { ignore_missing: true, ..sqlx::migrate!("../migrations") };

/// A pool of at most `max` connections to the configured database.
///
/// # Errors
/// The URL does not parse or the database cannot be reached; the error names the address
/// (never the password).
pub async fn connect(config: &Config, max: u32) -> anyhow::Result<PgPool> {
    let options = connect_options(config)?;
    let target = target(&options);
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .with_context(|| format!("connecting to Postgres at {target}"))
}

/// How every jobfold session connects: the configured URL, with JIT compilation off.
///
/// jobfold's statements are short and many; Postgres compiles a statement whose estimated cost
/// passes `jit_above_cost` whatever it will really cost. A gauge that counts a backlog
/// estimated at a million rows spent about 50 ms compiling on each reading while the backlog
/// held a few hundred (`docs/operations.md`, the gauges). Set per session, so the
/// cluster's setting stays as it is for everyone else.
///
/// # Errors
/// The URL does not parse.
pub fn connect_options(config: &Config) -> anyhow::Result<PgConnectOptions> {
    let options: PgConnectOptions =
        config.database_url.expose().parse().context("parsing database_url")?;
    Ok(options.options([("jit", "off")]))
}

/// Where `options` connect: `host:port/database as user`, without the password.
fn target(options: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{} as {}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("(default database)"),
        options.get_username()
    )
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

/// Creates database `name` (a scratch database: the demo's, a benchmark's). A database name
/// is an identifier, which Postgres takes in no parameter: Postgres writes the statement
/// itself (`format('%I')` quotes the name), and it is run as written.
///
/// # Errors
/// The database failed, or the name is taken.
pub async fn create_database(admin: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let statement =
        sqlx::query_scalar!(r#"SELECT format('CREATE DATABASE %I', $1::text) AS "sql!""#, name)
            .fetch_one(admin)
            .await?;
    sqlx::raw_sql(&statement).execute(admin).await?;
    Ok(())
}

/// Drops database `name` if it exists, ending its sessions; see [`create_database`].
///
/// # Errors
/// The database failed.
pub async fn drop_database(admin: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let statement = sqlx::query_scalar!(
        r#"SELECT format('DROP DATABASE IF EXISTS %I WITH (FORCE)', $1::text) AS "sql!""#,
        name
    )
    .fetch_one(admin)
    .await?;
    sqlx::raw_sql(&statement).execute(admin).await?;
    Ok(())
}

/// The SQLSTATE and message of a data error about the row being written: class 22 (data
/// exception: a NUL in text, a value out of range, bad encoding) or class 23 (integrity
/// constraint). Such an error is the fault of what was written, not of the database:
/// writing the same again fails the same way, so it must never be retried for ever.
pub fn data_error(e: &sqlx::Error) -> Option<(String, String)> {
    let sqlx::Error::Database(db) = e else { return None };
    let code = db.code()?;
    (code.starts_with("22") || code.starts_with("23"))
        .then(|| (code.into_owned(), db.message().to_owned()))
}

/// [`data_error`] for the `sqlx::Error` somewhere in an error's chain.
pub fn data_error_in(e: &anyhow::Error) -> Option<(String, String)> {
    e.chain().find_map(|c| c.downcast_ref::<sqlx::Error>()).and_then(data_error)
}
