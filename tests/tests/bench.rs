//! `jobfold bench` at a size too small to mean anything: every measurement runs against the
//! test services (limits, accept, the relay and processors as processes, a kill -9) and
//! lands in the table. The numbers themselves are not asserted: speed is the bench's
//! business, not a test's.

use std::process::Command;

use jobfold_tests::harness::jobfold_cli;
use jobfold_tests::services;

#[test]
fn the_bench_runs_every_measurement() {
    let scratch = || {
        Command::new("psql")
            .arg(services::database_url())
            .args(["-Atc", "SELECT count(*) FROM pg_database WHERE datname LIKE 'jobfold_bench_%'"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<i64>().unwrap_or(-1))
            .unwrap_or(-1)
    };
    let scratch_before = scratch();
    let table = std::env::temp_dir().join(format!("jobfold-bench-{}.md", std::process::id()));
    let output = jobfold_cli()
        .args(["bench", "--smoke", "--output"])
        .arg(&table)
        .output()
        .expect("running jobfold bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the bench failed:\n{stdout}\n{stderr}");
    let written = std::fs::read_to_string(&table).expect("the table file");
    let _ = std::fs::remove_file(&table);
    for row in [
        "| limit: Postgres commits, 1 client | ",
        "| limit: Postgres commits, 16 clients | ",
        "| limit: Postgres multi-row insert | ",
        "| limit: raw rdkafka producer | ",
        "| limit: raw rdkafka consumer | ",
        "| limit: a job's Postgres work alone | ",
        "| accept, 1 client | ",
        "| accept, 16 clients | ",
        "| accept, half that rate ",
        "| accept, batches of 100 | ",
        "| limit: the relay's log read alone | ",
        "| relay, draining a backlog ",
        "| relay, full accept load ",
        "| relay, half load ",
        "| relay peak RSS | ",
        "| end to end, trivial handler, burst | ",
        "| processor peak RSS, 300-job trivial burst | ",
        "| accept through the intake topic | ",
        "| end to end, trivial handler, burst through the intake topic | ",
        "| accept over HTTP, 24 clients | ",
        "| end to end, trivial handler, burst over HTTP, 24 clients | ",
        "| accept over HTTP, half that rate ",
        "| accept over HTTP in batches of 1,000 | ",
        "| end to end, trivial handler, burst over HTTP in batches of 1,000 | ",
        "| processor peak RSS, after the doors' bursts | ",
        "| end to end, steady ",
        "| slow jobs, 1 s handler, ",
        "| processor RSS, 50 remote jobs in flight | ",
        "| processor peak RSS | ",
        "| relay peak RSS, end to end | ",
        "| recovery after kill -9 of 1 of 2 processors | ",
        "| rolling restart of 2 of 2 processors (SIGTERM each, replaced) | ",
    ] {
        let line = written.lines().find(|l| l.starts_with(row));
        let line = line.unwrap_or_else(|| panic!("no row {row:?} in:\n{written}"));
        // Throughput and memory stand next to a limit; the limits and latency-only rows not.
        let latency_only =
            row.contains("half load") || row.contains("half that rate") || row.contains("steady");
        let compared = line.contains("% of ");
        assert!(compared || row.starts_with("| limit") || latency_only, "{line}");
    }
    // Where the relay's CPU went, next to the raw producer's (read from /proc).
    let drain = written.lines().find(|l| l.starts_with("| relay, draining")).unwrap();
    assert!(drain.contains("CPU per event") && drain.contains("the raw producer: "), "{drain}");
    // A job's own statements: the WAL and its backend's CPU a job, from Postgres and /proc.
    let alone = written.lines().find(|l| l.starts_with("| limit: a job's Postgres")).unwrap();
    assert!(alone.contains("B of WAL a job") && alone.contains("backend's CPU a job"), "{alone}");
    // Where each end-to-end job's CPU went, by component (read from /proc).
    for burst in written.lines().filter(|l| l.starts_with("| end to end, trivial")) {
        for part in ["CPU per job: ", "µs on the machine (", "Postgres ", "processor ", "relay "] {
            assert!(burst.contains(part), "no {part:?} in {burst}");
        }
    }
    // The doors' accepts count their commits; HTTP's are timed per request.
    let http = written.lines().find(|l| l.starts_with("| accept over HTTP, 24")).unwrap();
    assert!(http.contains("accept commits/job") && !http.contains("| – | – |"), "{http}");
    // A deploy's cost is the delay it adds, next to the same load's before it.
    let deploy = written.lines().find(|l| l.starts_with("| rolling restart")).unwrap();
    assert!(deploy.contains("against p99") && deploy.contains("given back"), "{deploy}");
    // Long remote jobs: all held at once as streams of a connection or a few (the client
    // may open another while its first is still being opened, more of them on a loaded
    // machine), never a connection a call as HTTP/1.1 takes; their callbacks answered.
    let remote =
        written.lines().find(|l| l.starts_with("| remote jobs in flight, 50 held")).unwrap();
    assert!(remote.contains("all 50 in flight"), "{remote}");
    let connections: usize = remote
        .split(" connection(s)")
        .next()
        .and_then(|before| before.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of connections: {remote}"));
    assert!((1..=5).contains(&connections), "50 held calls over {connections} connections");
    // The scratch databases are dropped again.
    assert!(scratch() <= scratch_before, "scratch databases left behind");
}
