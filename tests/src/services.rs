//! Where the test services listen, and a fail-fast check that they answer.
//!
//! Each address comes from the same `JOBFOLD_*` variable the binaries read, defaulting to
//! what `docker/services.sh` (and `docker/compose.yaml`) use.

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// The command that starts every service the tests need.
pub const START_COMMAND: &str = "docker/services.sh start";

/// `postgres://` URL of the `jobfold` database (`JOBFOLD_DATABASE_URL`).
pub fn database_url() -> String {
    var("JOBFOLD_DATABASE_URL", "postgres://jobfold:jobfold@127.0.0.1:5432/jobfold")
}

/// Kafka bootstrap servers (`JOBFOLD_KAFKA_BROKERS`).
pub fn kafka_brokers() -> String {
    var("JOBFOLD_KAFKA_BROKERS", "127.0.0.1:9092")
}

/// Base URL of the Confluent-compatible schema registry API (`JOBFOLD_SCHEMA_REGISTRY_URL`).
pub fn schema_registry_url() -> String {
    var("JOBFOLD_SCHEMA_REGISTRY_URL", "http://127.0.0.1:8081/apis/ccompat/v7")
}

/// The broker's SASL/PLAIN listener (`JOBFOLD_SASL_BROKERS`) and its user
/// (`JOBFOLD_SASL_USERNAME`, `JOBFOLD_SASL_PASSWORD`), as `docker/kafka.sh` configures them.
pub fn sasl() -> (String, String, String) {
    (
        var("JOBFOLD_SASL_BROKERS", "127.0.0.1:9094"),
        var("JOBFOLD_SASL_USERNAME", "jobfold"),
        var("JOBFOLD_SASL_PASSWORD", "local-sasl-password-7f3e"),
    )
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Panics with a message naming [`START_COMMAND`] unless `host:port` accepts connections.
///
/// Call it first in a test, so a missing service reads as a missing service and not as
/// a confusing time-out deep inside a client library.
pub fn require(service: &str, address: &str) {
    let reachable = address
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .any(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok());
    assert!(
        reachable,
        "{service} is not reachable at {address}: start the test services with `{START_COMMAND}`"
    );
}

/// [`require`] for the host and port of a URL such as `postgres://u:p@127.0.0.1:5432/db`.
pub fn require_url(service: &str, url: &str) {
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = after_scheme.split('/').next().unwrap_or(after_scheme);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    require(service, host_port);
}

/// Every service, checked at once.
pub fn require_all() {
    require_url("PostgreSQL", &database_url());
    for broker in kafka_brokers().split(',') {
        require("Kafka", broker);
    }
    require_url("the schema registry", &schema_registry_url());
}
