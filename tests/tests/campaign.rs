//! The short fault campaigns CI runs: a fixed seed on one broker and a Postgres primary with
//! a synchronous standby (20 faults, a failover among them), then a random
//! one (printed) on a three-broker cluster (12 faults, every second one striking Kafka). `jobfold-campaign --faults 200` (and `--brokers 3 --faults 100`) runs the long ones.

use jobfold_tests::campaign::{self, Outcome, Plan};

async fn campaign(plan: Plan) -> Outcome {
    let seed = plan.seed;
    println!("campaign seed {seed}, {} broker(s)", plan.brokers);
    let outcome = campaign::run(&plan).await.expect("the campaign runs");
    println!("{outcome}");
    assert!(outcome.held(), "the campaign with seed {seed} found problems:\n{outcome}");
    outcome
}

#[tokio::test(flavor = "multi_thread")]
async fn a_short_fault_campaign_loses_nothing_and_duplicates_nothing() {
    let outcome = campaign(Plan::short(20_261_129)).await;
    assert!(outcome.faults.values().sum::<u64>() >= 20, "{outcome}");
    assert!(outcome.faults.get(campaign::FAILOVER).is_some_and(|n| *n >= 1), "{outcome}");
    let outcome = campaign(Plan::short_cluster(rand::random())).await;
    let broker_faults: u64 =
        outcome.faults.iter().filter(|(kind, _)| kind.starts_with("Kafka:")).map(|(_, n)| n).sum();
    assert!(outcome.faults.values().sum::<u64>() >= 12, "{outcome}");
    assert!(broker_faults >= 6, "every second fault strikes Kafka:\n{outcome}");
}

/// Each fix the campaign was shown to catch, as a patch that reverts it
/// (docs/campaign.md#each-fix-reverted-the-checker-fails), still applies to the code.
#[test]
fn every_revert_patch_still_applies() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut patches: Vec<_> = std::fs::read_dir(root.join("tests/reverts"))
        .expect("tests/reverts")
        .map(|entry| entry.expect("an entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "patch"))
        .collect();
    patches.sort();
    assert_eq!(patches.len(), 22, "{patches:?}");
    for patch in patches {
        let status = std::process::Command::new("git")
            .args(["apply", "--check"])
            .arg(&patch)
            .current_dir(&root)
            .status()
            .expect("running git apply");
        assert!(
            status.success(),
            "{} no longer applies: redo it against the code",
            patch.display()
        );
    }
}

/// Each of the stricter checks finds its fault when it is forced on an installation: a
/// submission that made two jobs, a job superseded with no newer success, a well-behaved job
/// quarantined for a cause it did not carry; a quarantine by the deaths of processes the
/// campaign killed is counted, not a finding; a run with too few quiet stretches is.
#[tokio::test(flavor = "multi_thread")]
async fn the_stricter_checks_each_find_their_fault() {
    use jobfold_tests::harness::{Installation, index_job};
    use jobfold_tests::history::{self, Observed, QUIET_EXTRA, QUIET_STRETCHES};
    use serde_json::json;

    let it = Installation::new("checker").await;
    let acceptor = it.acceptor().await;
    let accept = |document: &'static str, version| {
        let acceptor = &acceptor;
        let pool = &it.pool;
        async move {
            acceptor
                .accept(pool, &index_job(document, version, json!({ "text": "x" })))
                .await
                .unwrap()
                .job_id
        }
    };
    let deaths = std::collections::HashSet::from([4242]);
    let (clean, _) = history::check_well_formed(&it.pool, &deaths).await;
    assert!(clean.is_empty(), "{clean:?}");

    // One submission, two jobs (as a retry that did not find the first would make).
    accept("doc-01", 1).await;
    accept("doc-01", 1).await;
    // Superseded, but its document's newer version did not succeed.
    let older = accept("doc-02", 1).await;
    accept("doc-02", 2).await;
    // Quarantined: one for nothing it carried, one by a process the campaign killed, one for
    // its own input.
    let uncaused = accept("doc-03", 1).await;
    let by_death = accept("doc-04", 1).await;
    let carried = accept("doc-05", 1).await;
    let set = |job, state: &'static str| {
        let pool = &it.pool;
        async move {
            sqlx::query(
                "UPDATE jobs SET state = $2::job_state, finished_at = now() WHERE job_id = $1",
            )
            .bind(job)
            .bind(state)
            .execute(pool)
            .await
            .unwrap();
        }
    };
    set(older, "superseded").await;
    for (job, reason) in [
        (uncaused, "permanent failure: boom".to_owned()),
        (
            by_death,
            "attempt budget spent (5 attempts); last error: the process running it (vm/4242) \
             died before its attempt committed (crash 1 of max_crashes 3)"
                .to_owned(),
        ),
        (carried, format!("invalid input: {}", history::NO_TEXT)),
    ] {
        set(job, "quarantined").await;
        sqlx::query(
            "INSERT INTO quarantine (job_id, reason, error_class, input_version, attempts, owner) \
             VALUES ($1, $2, 'permanent', 1, 1, 'test')",
        )
        .bind(job)
        .bind(reason)
        .execute(&it.pool)
        .await
        .unwrap();
    }
    let (findings, ended_by_deaths) = history::check_well_formed(&it.pool, &deaths).await;
    assert_eq!(findings.len(), 3, "{findings:#?}");
    assert!(findings[0].contains("doc-01 v1: 2 jobs"), "{findings:#?}");
    assert!(findings[1].contains(&older.to_string()), "{findings:#?}");
    assert!(
        findings[2].contains(&uncaused.to_string()) && findings[2].contains("boom"),
        "{findings:#?}"
    );
    assert!(!findings[2].contains(&carried.to_string()), "its own input: {findings:#?}");
    assert_eq!(ended_by_deaths, 1);
    // The same death, but of a process the campaign did not kill: a finding.
    let (findings, _) = history::check_well_formed(&it.pool, &Default::default()).await;
    assert!(findings[2].contains(&by_death.to_string()), "{findings:#?}");

    // Quiet stretches: gaps between faults longer than a window and QUIET_EXTRA.
    let t0 = chrono::Utc::now();
    let at = |secs: i64| (t0 + chrono::Duration::seconds(secs), "a fault".to_owned());
    let window = std::time::Duration::from_secs(25);
    let long = 25 + QUIET_EXTRA.as_secs() as i64;
    let observed = |faults| Observed { faults, fault_window: window, ..Observed::default() };
    let few = observed(vec![at(0), at(3), at(3 + long), at(6 + long)]);
    assert_eq!(few.quiet_stretches(QUIET_EXTRA), 1);
    let enough = observed((0..=QUIET_STRETCHES as i64).map(|i| at(i * (long + 1))).collect());
    assert_eq!(enough.quiet_stretches(QUIET_EXTRA), QUIET_STRETCHES);
    it.cleanup().await;
}
