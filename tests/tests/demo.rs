//! `jobfold demo --short`, the README's first command in its test size: it runs against the
//! test services, kills a processor and crashes a relay midway, and its own summary checks
//! the run. The test reads that summary.

use jobfold_tests::harness::jobfold_cli;

#[test]
fn the_demo_runs_end_to_end_and_its_summary_checks_out() {
    let output = jobfold_cli().args(["demo", "--short"]).output().expect("running jobfold demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the demo failed:\n{stdout}\n{stderr}");
    for expected in [
        "[ok  ] every accepted job accounted for",
        "[ok  ] 0 duplicate business writes",
        "[ok  ] the highest succeeded version is the one summarized",
        "[ok  ] replay --verify from Postgres",
        "[ok  ] replay --verify from Kafka",
        "[ok  ] duplicates delivered",
        ">>> relay-1 crashed between producing a batch and marking it",
        "Where to look next",
        "Stopped what the demo started.",
    ] {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
    assert!(!stdout.contains("[FAIL]"), "{stdout}");
    // The processor killed held work when it died: partitions and running jobs.
    let kill = stdout
        .lines()
        .find(|l| l.contains("[ok  ]") && l.contains("was killed with SIGKILL holding"))
        .unwrap_or_else(|| panic!("no kill check in:\n{stdout}"));
    let numbers: Vec<u64> = kill
        .split_whitespace()
        .skip_while(|w| *w != "holding")
        .filter_map(|w| w.parse().ok())
        .take(2)
        .collect();
    assert!(numbers.len() == 2 && numbers.iter().all(|&n| n > 0), "{kill}");
    assert!(kill.contains("took over its partitions"), "{kill}");
}
