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
