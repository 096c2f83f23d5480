//! Postgres: connection pools and the embedded migrations.

use std::time::Duration;

use anyhow::Context;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::config::{Config, ConfigError};

mod primary;
pub use crate::pg_hosts::Hosts;
pub use primary::in_recovery;

/// How long a binary looks for a host that accepts writes at start.
const START_WAIT: Duration = Duration::from_secs(10);

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
/// With several hosts in `database_url` (or `target_session_attrs=read-write`), the pool
/// connects to the one accepting writes, refuses connections to a standby, and follows a
/// failover (a task per pool, `db/primary.rs`). With `database.require_sync_standby`, a
/// primary that acknowledges commits without a synchronous standby is refused.
///
/// # Errors
/// The URL does not parse or the database cannot be reached; the error names the address
/// (never the password). [`ConfigError`] when `database.require_sync_standby` is not met.
pub async fn connect(config: &Config, max: u32) -> anyhow::Result<PgPool> {
    let (hosts, primary_only) = connect_options(config)?;
    let options =
        PgPoolOptions::new().max_connections(max).acquire_timeout(Duration::from_secs(10));
    let pool = if primary_only {
        let router = primary::Router::new(hosts);
        let deadline = tokio::time::Instant::now() + START_WAIT;
        let (i, conn) = loop {
            match router.find_primary().await {
                Ok(found) => break found,
                Err(answers) if tokio::time::Instant::now() >= deadline => {
                    anyhow::bail!("connecting to Postgres: no host accepts writes ({answers})")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        };
        let target = target(&router.hosts()[i]);
        let pool = options
            .after_connect(|conn, _| {
                Box::pin(async move {
                    if in_recovery(conn).await? { Err(primary::on_a_standby()) } else { Ok(()) }
                })
            })
            .connect_with(router.hosts()[i].clone())
            .await
            .with_context(|| format!("connecting to Postgres at {target}"))?;
        router.switch(&pool, i);
        tokio::spawn(router.follow(pool.clone(), config.database.primary_check, Some(conn)));
        pool
    } else {
        let options_one = hosts.into_iter().next().expect("a host");
        let target = target(&options_one);
        options
            .connect_with(options_one)
            .await
            .with_context(|| format!("connecting to Postgres at {target}"))?
    };
    if config.database.require_sync_standby {
        check_sync_standby(&pool).await?;
    }
    Ok(pool)
}

/// One connection outside `pool`, to where its connections go now (the primary it follows),
/// refused if that is a standby: a connection that must hold a session of its own, as the
/// relay's advisory lock.
///
/// # Errors
/// The database cannot be reached, or answers as a standby.
pub async fn connect_one(pool: &PgPool, application: &str) -> Result<PgConnection, sqlx::Error> {
    let options = pool.connect_options().as_ref().clone().application_name(application);
    let mut conn = options.connect().await?;
    if in_recovery(&mut conn).await? {
        primary::close(conn).await;
        return Err(primary::on_a_standby());
    }
    Ok(conn)
}

/// Refuses a primary that acknowledges jobfold's commits before a synchronous standby has
/// them: `synchronous_standby_names` empty, or `synchronous_commit` `off` or `local` for
/// this session (a role's or database's setting included).
///
/// # Errors
/// [`ConfigError`] naming `database.require_sync_standby`; the database failed.
pub async fn check_sync_standby(pool: &PgPool) -> anyhow::Result<()> {
    let row = sqlx::query!(
        r#"SELECT current_setting('synchronous_standby_names') AS "names!",
                  current_setting('synchronous_commit') AS "commit!""#
    )
    .fetch_one(pool)
    .await
    .context("reading the primary's synchronous replication settings")?;
    let at = target(&pool.connect_options());
    let problem = if row.names.trim().is_empty() {
        Some("synchronous_standby_names is empty".to_owned())
    } else if matches!(row.commit.as_str(), "off" | "local") {
        Some(format!("synchronous_commit is {} for jobfold's sessions", row.commit))
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(ConfigError::Named {
            key: "key `database.require_sync_standby`".into(),
            problem: format!(
                "the primary at {at} acknowledges a commit before any standby has it ({problem}): \
                 a failover would lose jobs already acknowledged; name a synchronous standby in \
                 synchronous_standby_names with synchronous_commit on (docs/postgres.md), or set \
                 database.require_sync_standby = false"
            ),
        }
        .into());
    }
    tracing::info!(
        synchronous_standby_names = %row.names,
        synchronous_commit = %row.commit,
        "Postgres acknowledges commits once a synchronous standby has them."
    );
    Ok(())
}

/// How every jobfold session connects: to each host of the configured URL, with JIT
/// compilation off; and whether only a primary will do ([`Hosts::primary_only`]).
///
/// jobfold's statements are short and many; Postgres compiles a statement whose estimated cost
/// passes `jit_above_cost` whatever it will really cost. A gauge that counts a backlog
/// estimated at a million rows spent about 50 ms compiling on each reading while the backlog
/// held a few hundred (`docs/operations.md`, the gauges). Set per session, so the
/// cluster's setting stays as it is for everyone else.
///
/// # Errors
/// The URL does not parse.
fn connect_options(config: &Config) -> anyhow::Result<(Vec<PgConnectOptions>, bool)> {
    let hosts = Hosts::parse(config.database_url.expose())
        .map_err(|problem| anyhow::anyhow!("database_url: {problem}"))?;
    let options = hosts
        .urls
        .iter()
        .map(|url| {
            let options: PgConnectOptions = url.parse().context("parsing database_url")?;
            Ok(options.options([("jit", "off")]))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok((options, hosts.primary_only))
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
