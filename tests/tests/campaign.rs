//! The short fault campaign CI runs: a fixed seed, then a random one (printed), each with
//! about 20 faults. `jobfold-campaign --faults 200` runs the long one.

use jobfold_tests::campaign::{self, Plan};

async fn campaign(seed: u64) {
    println!("campaign seed {seed}");
    let outcome = campaign::run(&Plan::short(seed)).await.expect("the campaign runs");
    println!("{outcome}");
    assert!(outcome.held(), "the campaign with seed {seed} found problems:\n{outcome}");
    assert!(outcome.faults.values().sum::<u64>() >= 20, "{outcome}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_short_fault_campaign_loses_nothing_and_duplicates_nothing() {
    campaign(20_261_129).await;
    campaign(rand::random()).await;
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
    assert_eq!(patches.len(), 4, "{patches:?}");
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
