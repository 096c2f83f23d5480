//! Who may call the HTTP API, and from where.
//!
//! Before any handler runs, each request passes, in this order:
//! 1. **Host.** Its `Host` (or HTTP/2 authority) must be one `http.allowed_hosts` lists,
//!    `localhost`, `127.0.0.1`, `[::1]` or `http_addr`'s address; any other is answered 421.
//!    A page that rebinds its own name to this address sends its own name as `Host`, so it
//!    reaches nothing, with a token or without. `/healthz` and `/readyz` (they tell nothing)
//!    answer any `Host`: probes address a process by its IP.
//! 2. **Origin.** A mutating request a browser sends from another origin is refused (403).
//! 3. **Token.** With tokens configured (`http.tokens`, `api_token`), every route but the
//!    probes, the console's page and (unless `http.open_metrics = false`) `/metrics` needs
//!    `Authorization: Bearer <secret>` (the scheme in any case) of a token whose role allows
//!    it ([`required`]): none or an unknown one 401, a role too low 403. Secrets are kept as
//!    SHA-256 digests and compared in constant time with every token's. A client address
//!    that fails `http.auth_failures_per_minute` times in a minute is answered 429 until the
//!    minute is over, a right token included (IPv6 addresses counted by their /64).
//!
//! What passes carries its [`Principal`] (the token's name and role) in the request's
//! extensions: the handlers record it in the audit trail. Without any token configured the
//! API is open and the principal is `anonymous` with every role.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::Method;
use jobfold_common::config::{Config, Role, split_host_port};
use sha2::{Digest, Sha256};

/// Who made a request, as the access check found: a token's name and role, or `anonymous`
/// (no token configured: every role).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
}

impl Principal {
    pub fn anonymous() -> Self {
        Self { name: "anonymous".into(), role: Role::Admin }
    }
}

/// A token as the API keeps it: the digest of its secret.
#[derive(Debug)]
struct Known {
    name: String,
    role: Role,
    digest: [u8; 32],
}

/// The window failed authentications are counted in.
const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// Client addresses tracked at once; past it, windows that ended are forgotten, and if none
/// has, the address is not tracked (the limit cannot be made to grow memory without end).
const MAX_TRACKED: usize = 65_536;

/// The access rules of one API.
#[derive(Debug)]
pub struct Access {
    tokens: Vec<Known>,
    hosts: Vec<String>,
    any_host: bool,
    open_metrics: bool,
    max_failures: u32,
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

/// Why a request may not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 421: a `Host` the API does not answer to.
    Host(String),
    /// 401: no token, or one no configured token matches.
    Unauthenticated,
    /// 403: the token's role is below the route's.
    Forbidden { name: String, role: Role, needs: Role },
    /// 429: too many failed authentications from this address; try again after this long.
    TooManyFailures(Duration),
}

/// The SHA-256 of `secret` in hex, as `http.tokens` stores it.
pub fn digest_hex(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

impl Access {
    pub fn new(config: &Config) -> Self {
        let mut tokens: Vec<Known> = config
            .http
            .tokens
            .iter()
            .map(|t| {
                let mut digest = [0u8; 32];
                // Validated: 64 hex digits.
                let _ = hex::decode_to_slice(&t.sha256, &mut digest);
                Known { name: t.name.trim().to_owned(), role: t.role, digest }
            })
            .collect();
        if let Some(secret) = &config.api_token {
            tokens.push(Known {
                name: "api_token".into(),
                role: Role::Admin,
                digest: Sha256::digest(secret.expose().trim().as_bytes()).into(),
            });
        }
        let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "[::1]"].map(String::from).into();
        let listen = config.http_addr.ip();
        if !listen.is_unspecified() {
            hosts.push(match listen {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            });
        }
        hosts.extend(config.http.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
        Self {
            tokens,
            any_host: config.http.allowed_hosts.iter().any(|h| h == "*"),
            hosts,
            open_metrics: config.http.open_metrics,
            max_failures: config.http.auth_failures_per_minute,
            failures: Mutex::default(),
        }
    }

    /// Whether any token is configured (else the API is open).
    pub fn tokens_required(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whether the API answers to `host` (a `Host` header's value).
    pub fn host_allowed(&self, host: &str) -> bool {
        if self.any_host {
            return true;
        }
        let host = host.trim().trim_end_matches('.').to_ascii_lowercase();
        let (name, port) = split_host_port(&host);
        let name = name.trim_end_matches('.');
        self.hosts.iter().any(|pattern| {
            let (want, want_port) = split_host_port(pattern);
            if want_port.is_some() && want_port != port {
                return false;
            }
            match want.strip_prefix("*.") {
                Some(domain) => {
                    name.len() > domain.len() + 1
                        && name.ends_with(domain)
                        && name.as_bytes()[name.len() - domain.len() - 1] == b'.'
                }
                None => name == want,
            }
        })
    }

    /// The role `method` on `path` needs, or `None` if it is open to anyone.
    pub fn required(&self, method: &Method, path: &str) -> Option<Role> {
        if !self.tokens_required() {
            return None;
        }
        match path {
            "/healthz" | "/readyz" | "/v1/auth" => None,
            "/metrics" if self.open_metrics => None,
            "/ui" | "/ui/" | "/ui/console.js" | "/ui/console.css" if method == Method::GET => None,
            _ => Some(required(method, path)),
        }
    }

    /// The principal `authorization` (an `Authorization` header's value) names, counting a
    /// failure against `client`.
    ///
    /// # Errors
    /// [`Refusal::TooManyFailures`] while `client` is past its failures, whatever it sends;
    /// else [`Refusal::Unauthenticated`] for a missing or unknown token (only an unknown one
    /// counts as a failure).
    pub fn authenticate(
        &self,
        client: Option<IpAddr>,
        authorization: Option<&str>,
    ) -> Result<Principal, Refusal> {
        if !self.tokens_required() {
            return Ok(Principal::anonymous());
        }
        let client = client.map(counted);
        if let Some(wait) = client.and_then(|c| self.locked_out(c)) {
            return Err(Refusal::TooManyFailures(wait));
        }
        let found = authorization.and_then(bearer).and_then(|secret| self.identify(secret));
        match found {
            Some(known) => Ok(Principal { name: known.name.clone(), role: known.role }),
            None => {
                // A request without credentials guesses nothing: only a wrong token counts.
                if let Some(client) = client.filter(|_| authorization.is_some()) {
                    self.failed(client);
                }
                Err(Refusal::Unauthenticated)
            }
        }
    }

    /// The token whose secret is `secret`: its digest compared with every token's, in
    /// constant time, without stopping at a match.
    fn identify(&self, secret: &str) -> Option<&Known> {
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        let mut found = None;
        for known in &self.tokens {
            let same = known.digest.iter().zip(&digest).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            if same && found.is_none() {
                found = Some(known);
            }
        }
        found
    }

    fn locked_out(&self, client: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().ok()?;
        let (since, count) = failures.get(&client)?;
        let left = FAILURE_WINDOW.checked_sub(since.elapsed())?;
        (*count >= self.max_failures).then_some(left)
    }

    fn failed(&self, client: IpAddr) {
        let Ok(mut failures) = self.failures.lock() else { return };
        if failures.len() >= MAX_TRACKED && !failures.contains_key(&client) {
            failures.retain(|_, (since, _)| since.elapsed() < FAILURE_WINDOW);
            if failures.len() >= MAX_TRACKED {
                return;
            }
        }
        let entry = failures.entry(client).or_insert((Instant::now(), 0));
        if entry.0.elapsed() >= FAILURE_WINDOW {
            *entry = (Instant::now(), 0);
        }
        entry.1 = entry.1.saturating_add(1);
        if entry.1 == self.max_failures {
            metrics::counter!(crate::metrics::AUTH_LOCKOUTS_TOTAL).increment(1);
            tracing::warn!(client = %client, failures = entry.1, "Too many failed authentications from one address: refused for the rest of the minute.");
        }
    }
}

/// The address failures are counted by: an IPv6 client by its /64 (one host holds a whole
/// /64 and could otherwise change address at every try).
fn counted(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

/// The secret of a `Bearer` credential; the scheme in any case (RFC 6750, RFC 9110 §11.1).
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, secret) = authorization.trim().split_once([' ', '\t'])?;
    let secret = secret.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !secret.is_empty()).then_some(secret)
}

/// Whether `path` is a handler's callback (`/v1/jobs/{id}/heartbeat` or `/complete`).
pub fn is_callback(path: &str) -> bool {
    path.strip_prefix("/v1/jobs/").is_some_and(|rest| {
        rest.split_once('/')
            .is_some_and(|(id, route)| !id.is_empty() && matches!(route, "heartbeat" | "complete"))
    })
}

/// The role `method` on `path` needs once tokens are configured: reads `read`; accepting
/// jobs and a handler's callbacks (unsigned: its kind has no secret) `submit`; deleting
/// `admin`; any other change `operate`.
pub fn required(method: &Method, path: &str) -> Role {
    match *method {
        Method::GET | Method::HEAD | Method::OPTIONS => Role::Read,
        Method::DELETE => Role::Admin,
        Method::POST if path == "/v1/jobs" || path == "/v1/jobs/batch" || is_callback(path) => {
            Role::Submit
        }
        _ => Role::Operate,
    }
}

/// The client's address, as the connection gave it.
pub fn client_ip(addr: Option<&axum::extract::ConnectInfo<SocketAddr>>) -> Option<IpAddr> {
    addr.map(|a| a.0.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(tokens: &[(&str, Role, &str)], hosts: &[&str]) -> Access {
        let mut config = Config::load(None).expect("the defaults load");
        config.http.tokens = tokens
            .iter()
            .map(|(name, role, secret)| jobfold_common::config::ApiToken {
                name: (*name).into(),
                role: *role,
                sha256: digest_hex(secret),
            })
            .collect();
        config.http.allowed_hosts = hosts.iter().map(|h| (*h).to_owned()).collect();
        config.http.auth_failures_per_minute = 3;
        Access::new(&config)
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc "), Some("abc"));
        assert_eq!(bearer("BEARER\tabc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("Bearerabc"), None);
    }

    #[test]
    fn only_listed_hosts_and_local_names_are_answered() {
        let a = access(&[], &["jobs.internal", "*.example.com", "api.test:8443"]);
        for ok in [
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "LOCALHOST",
            "jobs.internal",
            "jobs.internal:80",
            "a.example.com",
            "b.a.example.com:9",
            "api.test:8443",
        ] {
            assert!(a.host_allowed(ok), "{ok}");
        }
        for refused in [
            "evil.test",
            "example.com",
            "xexample.com",
            "api.test",
            "api.test:8444",
            "localhost.evil.test",
            "",
        ] {
            assert!(!a.host_allowed(refused), "{refused}");
        }
        assert!(access(&[], &["*"]).host_allowed("anything.test"));
    }

    #[test]
    fn roles_follow_the_routes_and_only_a_token_names_its_principal() {
        let a = access(&[("dash", Role::Read, "read-secret-0123456789")], &[]);
        assert_eq!(a.required(&Method::GET, "/healthz"), None);
        assert_eq!(a.required(&Method::GET, "/ui/"), None);
        assert_eq!(a.required(&Method::GET, "/metrics"), None);
        assert_eq!(a.required(&Method::GET, "/v1/jobs/x/input"), Some(Role::Read));
        assert_eq!(a.required(&Method::POST, "/v1/jobs"), Some(Role::Submit));
        assert_eq!(a.required(&Method::POST, "/v1/jobs/x/heartbeat"), Some(Role::Submit));
        assert_eq!(a.required(&Method::POST, "/v1/jobs/x/complete"), Some(Role::Submit));
        assert_eq!(a.required(&Method::POST, "/v1/jobs/x/completes"), Some(Role::Operate));
        assert_eq!(a.required(&Method::POST, "/v1/jobs/x/cancel"), Some(Role::Operate));
        assert_eq!(a.required(&Method::DELETE, "/v1/dead-letters/1"), Some(Role::Admin));
        let who = a.authenticate(None, Some("bearer read-secret-0123456789")).unwrap();
        assert_eq!(who, Principal { name: "dash".into(), role: Role::Read });
        assert_eq!(a.authenticate(None, Some("Bearer wrong")), Err(Refusal::Unauthenticated));
        assert_eq!(a.authenticate(None, None), Err(Refusal::Unauthenticated));
        // No token configured: open, anonymous.
        let open = access(&[], &[]);
        assert_eq!(open.required(&Method::DELETE, "/v1/dead-letters/1"), None);
        assert_eq!(open.authenticate(None, None), Ok(Principal::anonymous()));
    }

    #[test]
    fn an_address_past_its_failures_is_refused_even_the_right_token() {
        let a = access(&[("ops", Role::Operate, "operate-secret-0123456789")], &[]);
        let (one, other): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for _ in 0..3 {
            assert_eq!(
                a.authenticate(Some(one), Some("Bearer nope")),
                Err(Refusal::Unauthenticated)
            );
        }
        let right = Some("Bearer operate-secret-0123456789");
        assert!(matches!(a.authenticate(Some(one), right), Err(Refusal::TooManyFailures(_))));
        assert!(a.authenticate(Some(other), right).is_ok());
        // One IPv6 host is one /64.
        let v6 = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        for i in 0..3 {
            let _ = a.authenticate(v6(&format!("2001:db8::{i}")), Some("Bearer nope"));
        }
        assert!(matches!(
            a.authenticate(v6("2001:db8::ffff"), right),
            Err(Refusal::TooManyFailures(_))
        ));
    }
}
