//! The short fault campaigns CI runs: a fixed seed on one broker (20 faults), then a random
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
    assert_eq!(patches.len(), 15, "{patches:?}");
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
