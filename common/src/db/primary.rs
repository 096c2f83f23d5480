//! A primary and its standbys: a database URL with several hosts, and pools that follow the
//! one accepting writes.
//!
//! sqlx connects to one host. A URL such as
//! `postgres://u:p@pg1:5432,pg2:5432/jobfold?target_session_attrs=read-write` (libpq's form)
//! is read here as one single-host URL per host. A pool connects to the host found
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

/// The hosts of `database_url`, each as a URL of its own, and whether only a primary will do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// One `postgres://` URL per host, in the order given, without `target_session_attrs`.
    pub urls: Vec<String>,
    /// Only a server accepting writes: several hosts, or `target_session_attrs` `read-write`
    /// or `primary`.
    pub primary_only: bool,
}

impl Hosts {
    /// Reads `postgres://[user[:password]@]host[:port][,host[:port]...][/db][?params]`.
    ///
    /// # Errors
    /// A problem to report against `database_url`: an empty host, or a
    /// `target_session_attrs` that asks for a standby (jobfold writes).
    pub fn parse(url: &str) -> Result<Self, String> {
        let (scheme, rest) = url.split_once("://").ok_or("must be a postgres:// URL")?;
        let (userinfo, after) = match rest.rfind('@') {
            Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
            None => (None, rest),
        };
        let end = after.find(['/', '?']).unwrap_or(after.len());
        let (host_list, tail) = after.split_at(end);
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let mut attrs = None;
        let params: Vec<&str> = query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|p| !p.is_empty())
            .filter(|p| match p.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    attrs = Some(value.to_owned());
                    false
                }
                _ => true,
            })
            .collect();
        let primary_only = match attrs.as_deref() {
            None | Some("any") => false,
            Some("read-write" | "primary") => true,
            Some(other) => {
                return Err(format!(
                    "target_session_attrs={other}: jobfold writes, so only read-write (or primary, \
                     or any) will do"
                ));
            }
        };
        let hosts: Vec<&str> = host_list.split(',').collect();
        // One empty host is the default one (or a socket named in the parameters).
        if hosts.len() > 1 && hosts.iter().any(|h| h.trim().is_empty()) {
            return Err("names an empty host (hosts are separated by commas)".into());
        }
        let query =
            if params.is_empty() { String::new() } else { format!("?{}", params.join("&")) };
        let userinfo = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let urls =
            hosts.iter().map(|host| format!("{scheme}://{userinfo}{host}{path}{query}")).collect();
        Ok(Self { primary_only: primary_only || hosts.len() > 1, urls })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_is_one_url() {
        let hosts = Hosts::parse("postgres://u:p@127.0.0.1:5432/jobfold").unwrap();
        assert_eq!(hosts.urls, ["postgres://u:p@127.0.0.1:5432/jobfold"]);
        assert!(!hosts.primary_only);
    }

    #[test]
    fn several_hosts_are_a_url_each_and_only_a_primary_will_do() {
        let hosts = Hosts::parse(
            "postgresql://u:p@ss@pg1:5432,[::1]:5433,pg3/jobfold?sslmode=disable&target_session_attrs=read-write&application_name=x",
        )
        .unwrap();
        assert_eq!(
            hosts.urls,
            [
                "postgresql://u:p@ss@pg1:5432/jobfold?sslmode=disable&application_name=x",
                "postgresql://u:p@ss@[::1]:5433/jobfold?sslmode=disable&application_name=x",
                "postgresql://u:p@ss@pg3/jobfold?sslmode=disable&application_name=x",
            ]
        );
        assert!(hosts.primary_only);
        for url in &hosts.urls {
            url.parse::<PgConnectOptions>().expect("sqlx reads each");
        }
        // Several hosts need a primary whatever the attribute says.
        assert!(Hosts::parse("postgres://a,b/db").unwrap().primary_only);
        assert!(Hosts::parse("postgres://a/db?target_session_attrs=primary").unwrap().primary_only);
    }

    #[test]
    fn a_standby_or_an_empty_host_is_refused() {
        for (url, says) in [
            ("postgres://a,b/db?target_session_attrs=read-only", "read-only"),
            ("postgres://a/db?target_session_attrs=prefer-standby", "prefer-standby"),
            ("postgres://a,,b/db", "empty host"),
            ("postgres://u@a,/db", "empty host"),
        ] {
            let problem = Hosts::parse(url).expect_err(url);
            assert!(problem.contains(says), "{url}: {problem}");
        }
    }
}
