//! The hosts of a `postgres://` URL in libpq's multi-host form, each as a URL of its own that
//! sqlx reads (it takes one host): `postgres://u:p@pg1:5432,pg2:5432/jobfold?target_session_attrs=read-write`.
//! No I/O: the configuration checks a URL with it, `crate::db` connects with it.

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

/// `url` naming database `name` instead of its own, its hosts and parameters kept (a
/// scratch database on the same servers).
///
/// # Errors
/// `url` is not a `postgres://` URL.
pub fn with_database(url: &str, name: &str) -> Result<String, String> {
    let (scheme, rest) = url.split_once("://").ok_or("must be a postgres:// URL")?;
    let after_user = rest.rfind('@').map_or(0, |at| at + 1);
    let end = rest[after_user..].find(['/', '?']).map_or(rest.len(), |i| after_user + i);
    let (head, tail) = rest.split_at(end);
    let query = tail.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
    Ok(format!("{scheme}://{head}/{name}{query}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::postgres::PgConnectOptions;

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
    fn another_database_keeps_the_hosts_and_parameters() {
        for (url, renamed) in [
            ("postgres://u:p@h:5432/jobfold", "postgres://u:p@h:5432/scratch"),
            (
                "postgres://u:p/q@h1,h2:5433/jobfold?target_session_attrs=read-write",
                "postgres://u:p/q@h1,h2:5433/scratch?target_session_attrs=read-write",
            ),
            ("postgres://h?sslmode=disable", "postgres://h/scratch?sslmode=disable"),
        ] {
            assert_eq!(with_database(url, "scratch").unwrap(), renamed);
        }
        assert!(with_database("h/db", "x").is_err());
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
