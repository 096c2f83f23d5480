//! A primary and its standbys: a database URL with several hosts, and pools that follow the
//! one accepting writes.
//!
//! sqlx connects to one host; [`crate::pg_hosts`] reads a URL naming several as one URL per
//! host. A pool connects to the host found
//! accepting writes, and every connection it opens is checked to be on a primary (a
//! standby's is refused and the pool tries again); a task per pool asks its host every
//! `database.primary_check` whether it still accepts writes and, once it does not (it died,
//! or it is a standby now), looks for the host that does and points the pool there. Old
//! connections die with the old primary (a promotion or a demotion restarts the server
//! behind them); the next statements open connections to the new one.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, PgPool};

/// Longest a connection attempt to one host may take while looking for the primary.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where a pool's connections go: the hosts, and which of them it uses now.
#[derive(Debug)]
pub(super) struct Router {
    hosts: Vec<PgConnectOptions>,
    current: AtomicUsize,
}

impl Router {
    pub(super) fn new(hosts: Vec<PgConnectOptions>) -> Arc<Self> {
        Arc::new(Self { hosts, current: AtomicUsize::new(0) })
    }

    /// Every host's options, in the URL's order.
    pub(super) fn hosts(&self) -> &[PgConnectOptions] {
        &self.hosts
    }

    /// The options of the host in use.
    pub(super) fn current(&self) -> &PgConnectOptions {
        &self.hosts[self.current.load(Ordering::Relaxed)]
    }

    /// The first host, from the one in use on, that accepts writes; what each other said.
    ///
    /// # Errors
    /// No host accepts writes: each host's answer.
    pub(super) async fn find_primary(&self) -> Result<(usize, PgConnection), String> {
        let start = self.current.load(Ordering::Relaxed);
        let mut refused = Vec::new();
        for i in (0..self.hosts.len()).map(|k| (start + k) % self.hosts.len()) {
            let host = &self.hosts[i];
            match probe(host).await {
                Ok(conn) => return Ok((i, conn)),
                Err(why) => refused.push(format!("{}: {why}", super::target(host))),
            }
        }
        Err(refused.join("; "))
    }

    /// Uses host `i` from now on: new connections of `pool` go there.
    pub(super) fn switch(&self, pool: &PgPool, i: usize) -> bool {
        let before = self.current.swap(i, Ordering::Relaxed);
        pool.set_connect_options(self.hosts[i].clone());
        before != i
    }

    /// Follows the primary for `pool` until the pool is closed: asks its host every `every`
    /// whether it still accepts writes, and when it does not, finds the one that does.
    pub(super) async fn follow(
        self: Arc<Self>,
        pool: PgPool,
        every: Duration,
        mut conn: Option<PgConnection>,
    ) {
        let mut lost_since: Option<std::time::Instant> = None;
        while !pool.is_closed() {
            tokio::time::sleep(every).await;
            if let Some(c) = conn.as_mut()
                && matches!(
                    tokio::time::timeout(PROBE_TIMEOUT, in_recovery(c)).await,
                    Ok(Ok(false))
                )
            {
                continue;
            }
            conn = None;
            match self.find_primary().await {
                Ok((i, found)) => {
                    conn = Some(found);
                    let from = super::target(self.current());
                    if self.switch(&pool, i) {
                        metrics::counter!(crate::metrics::PRIMARY_CHANGES_TOTAL).increment(1);
                        tracing::warn!(
                            from,
                            to = %super::target(self.current()),
                            "The Postgres primary moved: new connections go to the new one."
                        );
                    }
                    if let Some(since) = lost_since.take() {
                        tracing::info!(
                            after_ms = since.elapsed().as_millis() as u64,
                            "Postgres accepts writes again."
                        );
                    }
                    metrics::gauge!(crate::metrics::PRIMARY_UP).set(1.0);
                }
                Err(answers) => {
                    metrics::gauge!(crate::metrics::PRIMARY_UP).set(0.0);
                    if lost_since.is_none() {
                        lost_since = Some(std::time::Instant::now());
                        tracing::warn!(%answers, "No Postgres host accepts writes; looking again.");
                    }
                }
            }
        }
    }
}

/// A connection to `host` if it accepts writes.
async fn probe(host: &PgConnectOptions) -> Result<PgConnection, String> {
    let attempt = async {
        let mut conn = host.connect().await.map_err(|e| e.to_string())?;
        match in_recovery(&mut conn).await {
            Ok(false) => Ok(conn),
            Ok(true) => Err("a standby (in recovery)".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {PROBE_TIMEOUT:?}")))
}

/// Whether the server behind `conn` is a standby.
///
/// # Errors
/// The connection failed.
pub async fn in_recovery(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(r#"SELECT pg_is_in_recovery() AS "standby!""#).fetch_one(conn).await
}

/// The error a pool's connection to a standby is refused with: the pool tries again (by then,
/// to the primary the router found).
pub(super) fn on_a_standby() -> sqlx::Error {
    sqlx::Error::Configuration("connected to a standby (in recovery), not the primary".into())
}

/// Closes `conn` without waiting on a server that may be gone.
pub(super) async fn close(conn: PgConnection) {
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
}
