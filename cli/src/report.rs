//! What the command line prints after a change, the same whether it went to Postgres or
//! through the API (`--api`).

use jobfold_processor::dead_letter::Reinjected;
use jobfold_processor::store::kinds::KindChanged;
use jobfold_processor::store::{BulkCancelled, BulkReplayed, Waited};

pub(crate) fn submitted(job_id: uuid::Uuid, created: bool) {
    let what = if created { "accepted" } else { "already accepted" };
    println!("{job_id} {what}");
}

/// `was`: the job's state before the cancel.
pub(crate) fn cancelled(job_id: uuid::Uuid, was: &str) {
    if was == "cancelled" {
        println!("{job_id} was already cancelled");
    } else {
        println!("{job_id} cancelled (was {was})");
    }
}

pub(crate) fn bulk_cancelled(done: &BulkCancelled) {
    if done.dry_run {
        println!("{} open jobs match; nothing cancelled (--dry-run)", done.matched);
    } else {
        println!(
            "{} of {} jobs cancelled in {} transactions; {} still match",
            done.cancelled, done.matched, done.batches, done.remaining
        );
    }
}

pub(crate) fn ran_now(job_id: uuid::Uuid, waited: Waited) {
    match waited {
        Waited::Scheduled => println!("{job_id} was scheduled for later: dispatched now"),
        Waited::Retry => println!("{job_id} was waiting to retry: dispatched now"),
        Waited::Due => println!("{job_id} is already due: its dispatch is on its way"),
    }
}

pub(crate) fn replayed(job_id: uuid::Uuid, input_version: i64) {
    println!("{job_id} queued again at input version {input_version}");
}

pub(crate) fn bulk_replayed(done: &BulkReplayed) {
    if done.dry_run {
        println!("{} quarantined job(s) match; nothing replayed (--dry-run)", done.matched);
    } else {
        println!(
            "{} of {} matching job(s) replayed in {} transaction(s); {} still quarantined",
            done.replayed, done.matched, done.batches, done.remaining
        );
    }
}

/// `pause`: whether it was a pause (else a resume).
pub(crate) fn kind_changed(kind: &str, changed: &KindChanged, pause: bool) {
    match (pause, changed.was_paused) {
        (true, true) => println!("{kind} was already paused"),
        (true, false) => {
            println!("{kind} paused: its jobs wait until `jobfold kinds resume {kind}`");
        }
        (false, was_paused) => {
            let state = if was_paused { "resumed" } else { "was not paused" };
            println!("{kind} {state}; {} jobs that waited dispatched again", changed.dispatched);
        }
    }
}

pub(crate) fn reinjected(id: i64, sent: &Reinjected) {
    println!("dead letter {id} sent to {} [{}] @ {}", sent.topic, sent.partition, sent.offset);
}

pub(crate) fn dead_letter_deleted(id: i64) {
    println!("dead letter {id} deleted");
}
