//! Which transaction holds publication back.
//!
//! The relay reads only events below the cluster's oldest running transaction
//! (`pg_snapshot_xmin`, see [`crate::log`]): that is how its cursor never passes an event that
//! commits later. Transaction ids are shared by every database of a Postgres cluster, so a
//! transaction left open anywhere on it — another application's database, a `psql` session
//! idle in a transaction, a forgotten prepared transaction — holds back publishing for every
//! document until it ends. Nothing is lost; events wait.
//!
//! So the relay names the holder where operators look: the gauge
//! [`jobfold_relay_horizon_age_seconds`](crate::metrics::RELAY_HORIZON_AGE_SECONDS)
//! (how long the oldest transaction holding an id has been open) and, past
//! `relay.horizon_warn_after`, a log line with its backend's pid, database, application, user
//! and state. The remedies (in docs/operations.md): end it
//! (`pg_terminate_backend(pid)`), set `idle_in_transaction_session_timeout` on the cluster,
//! or give jobfold a cluster of its own.
//!
//! Other users' sessions show their transaction only to a role with `pg_read_all_stats`;
//! without it the log line says so.

use std::time::{Duration, Instant};

use crate::metrics as m;
use sqlx::PgConnection;

/// How often the same holder is logged again while it stays.
const REPEAT_EVERY: Duration = Duration::from_secs(60);

/// The transaction holding the horizon.
#[derive(Debug, Clone, PartialEq)]
pub struct Holder {
    /// The backend's pid; `None` for a prepared transaction (it has no backend).
    pub pid: Option<i32>,
    pub database: Option<String>,
    pub application: Option<String>,
    pub user_name: Option<String>,
    /// `idle in transaction`, `active`, ..., or `prepared` with its global id.
    pub state: Option<String>,
    /// Seconds since the transaction began (or was prepared).
    pub age_seconds: f64,
}

/// The oldest transaction holding a transaction id, in any database of the cluster (or a
/// prepared one), if any is visible to this role.
///
/// # Errors
/// The connection failed.
pub async fn holder(conn: &mut PgConnection) -> Result<Option<Holder>, sqlx::Error> {
    sqlx::query_as!(
        Holder,
        r#"
        SELECT pid, database, application, user_name, state, age_seconds AS "age_seconds!"
        FROM (
            SELECT a.pid, a.datname::text AS database, a.application_name AS application,
                   a.usename::text AS user_name, a.state,
                   EXTRACT(EPOCH FROM now() - a.xact_start)::float8 AS age_seconds,
                   age(a.backend_xid) AS xid_age
            FROM pg_stat_activity a
            WHERE a.backend_xid IS NOT NULL AND a.xact_start IS NOT NULL
            UNION ALL
            SELECT NULL, p.database::text, NULL, p.owner::text, 'prepared ' || p.gid,
                   EXTRACT(EPOCH FROM now() - p.prepared)::float8, age(p.transaction)
            FROM pg_prepared_xacts p
        ) running
        ORDER BY xid_age DESC
        LIMIT 1
        "#,
    )
    .fetch_optional(conn)
    .await
}

/// Watches the horizon: sets the gauge, logs a holder older than the warning age.
#[derive(Debug, Default)]
pub struct Watch {
    /// The holder last logged, and when.
    logged: Option<(Option<i32>, Instant)>,
}

impl Watch {
    /// Reads the holder, sets the gauge and logs it if it is older than `warn_after`.
    ///
    /// # Errors
    /// The connection failed.
    pub async fn check(
        &mut self,
        conn: &mut PgConnection,
        warn_after: Duration,
    ) -> Result<Option<Holder>, sqlx::Error> {
        let holder = holder(conn).await?;
        let age = holder.as_ref().map_or(0.0, |h| h.age_seconds.max(0.0));
        metrics::gauge!(m::RELAY_HORIZON_AGE_SECONDS).set(age);
        match &holder {
            Some(h) if age >= warn_after.as_secs_f64() => {
                let repeat = match self.logged {
                    Some((pid, at)) => pid != h.pid || at.elapsed() >= REPEAT_EVERY,
                    None => true,
                };
                if repeat {
                    tracing::warn!(
                        pid = h.pid,
                        database = h.database.as_deref().unwrap_or("?"),
                        application = h.application.as_deref().unwrap_or(""),
                        user = h.user_name.as_deref().unwrap_or("?"),
                        state = h.state.as_deref().unwrap_or("?"),
                        age_seconds = h.age_seconds.round(),
                        "A transaction open for {:.0}s holds back publishing for every \
                         document: the relay reads only below the oldest running transaction \
                         of the cluster. End it, or see docs/operations.md.",
                        h.age_seconds
                    );
                    self.logged = Some((h.pid, Instant::now()));
                }
            }
            _ => self.logged = None,
        }
        Ok(holder)
    }
}
