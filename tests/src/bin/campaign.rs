//! `jobfold-campaign`: the fault campaign with the history checker, as a command.
//!
//! ```sh
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --faults 200          # a random seed
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --seed 42 --faults 20 # replay a run
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --brokers 3 --faults 100 # on a cluster
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --pg-nodes 1 --faults 50  # one Postgres
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --faults 150 --failover-every 7
//! cargo run -p jobfold-tests --bin jobfold-campaign -- --release --faults 200  # release builds
//! ```
//!
//! It starts its own Postgres, Kafka and registry on ports from `--port-base` (the
//! `docker/` scripts; Java, Maven and the PostgreSQL server binaries must be installed),
//! and exits 1 if the history shows a lost job, a duplicate effect or no duplicate at all.

use std::process::ExitCode;

use clap::Parser;
use jobfold_tests::campaign::{self, Plan};

#[derive(Debug, Parser)]
struct Args {
    /// Seed of every random choice; random if absent (printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Faults to inject.
    #[arg(long, default_value_t = 200)]
    faults: usize,
    /// Shortest and longest pause between faults, in milliseconds.
    #[arg(long, value_delimiter = ',', default_value = "500,2500")]
    gap_ms: Vec<u64>,
    /// Jobs per second from each of the three producers.
    #[arg(long, default_value_t = 5.0)]
    rate: f64,
    /// Ports of the campaign's own services start above this one (default 25400; 25500 on
    /// a cluster).
    #[arg(long)]
    port_base: Option<u16>,
    /// Bad jobs, as a share of all the jobs submitted.
    #[arg(long, default_value_t = 0.1)]
    bad_share: f64,
    /// Kafka brokers: 1, or 3 for a KRaft cluster with replicated topics and broker faults
    /// (leader, coordinator and controller kills, a paused broker, rolling restarts).
    #[arg(long, default_value_t = 1, value_parser = brokers)]
    brokers: u8,
    /// Postgres servers: 2, a primary and a synchronous standby with failovers, switchovers
    /// and the standby's loss among the faults (the default on one broker); or 1, a server
    /// restarted (the default on a cluster).
    #[arg(long, value_parser = pg_nodes)]
    pg_nodes: Option<u8>,
    /// With a Postgres pair: a failover every N faults besides those dealt at random (once a
    /// run at least without it).
    #[arg(long)]
    failover_every: Option<usize>,
    /// Runs the relays, processors and registry from release builds, as they ship (built
    /// first if needed); debug builds otherwise, as the tests run them. On two cores a long
    /// run of debug builds with every bad job falls behind its own load.
    #[arg(long)]
    release: bool,
}

fn brokers(value: &str) -> Result<u8, String> {
    match value {
        "1" => Ok(1),
        "3" => Ok(3),
        _ => Err(format!("{value:?}: 1 or 3")),
    }
}

fn pg_nodes(value: &str) -> Result<u8, String> {
    match value {
        "1" => Ok(1),
        "2" => Ok(2),
        _ => Err(format!("{value:?}: 1 or 2")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if args.release {
        jobfold_tests::harness::use_release_builds();
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("campaign seed {seed}, {} faults", args.faults);
    let base = if args.brokers == 3 {
        Plan::cluster(seed, args.faults)
    } else {
        Plan::long(seed, args.faults)
    };
    let plan = Plan {
        gap_ms: (args.gap_ms[0], *args.gap_ms.get(1).unwrap_or(&args.gap_ms[0])),
        rate: args.rate,
        bad_share: args.bad_share.clamp(0.0, 0.9),
        port_base: args.port_base.unwrap_or(base.port_base),
        pg_nodes: args.pg_nodes.unwrap_or(base.pg_nodes),
        failover_every: args.failover_every,
        ..base
    };
    match campaign::run(&plan).await {
        Ok(outcome) => {
            print!("{outcome}");
            if outcome.held() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e) => {
            eprintln!("campaign seed {seed} could not run: {e:#}");
            ExitCode::FAILURE
        }
    }
}
