//! Named crash points for fault-injection tests.
//!
//! `JOBFOLD_FAILPOINT=relay-after-produce-before-mark` makes the process abort — no
//! destructors, no flushing, like `kill -9` — the first time it reaches that point;
//! `name@3` aborts on the third time; `name:panic` (or `name@3:panic`) panics there instead,
//! as a bug in the code at that point would. Several are separated by commas. Unset, a check
//! costs one uncontended lock of an empty map.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::sync::Mutex;

/// The relay produced a batch and got every delivery report, but has not marked it.
pub const RELAY_AFTER_PRODUCE_BEFORE_MARK: &str = "relay-after-produce-before-mark";
/// The processor committed a lease and has not run the handler.
pub const PROCESSOR_AFTER_LEASE_COMMIT: &str = "processor-after-lease-commit";
/// The handler returned; nothing of its result is committed.
pub const PROCESSOR_IN_HANDLER: &str = "processor-in-handler";
/// The completion transaction committed; the Kafka offset is not stored yet.
pub const PROCESSOR_AFTER_COMPLETION_BEFORE_OFFSET: &str =
    "processor-after-completion-before-offset-store";

/// The intake committed a batch of accepted requests; their offsets are not stored yet.
pub const INTAKE_AFTER_COMMIT_BEFORE_OFFSET: &str = "intake-after-commit-before-offset-store";

/// The processor's heartbeat task is about to beat (a crash here is the task's, not a
/// job's: the process must not run on without it).
pub const PROCESSOR_HEARTBEAT: &str = "processor-heartbeat";

/// Armed failpoints: name -> hits left before the abort (or the panic, if true).
static ARMED: LazyLock<Mutex<HashMap<String, (u64, bool)>>> = LazyLock::new(|| {
    let spec = std::env::var("JOBFOLD_FAILPOINT").unwrap_or_default();
    let armed = spec
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let (entry, panics) = match entry.strip_suffix(":panic") {
                Some(entry) => (entry, true),
                None => (entry, false),
            };
            match entry.split_once('@') {
                Some((name, n)) => (name.to_owned(), (n.parse().unwrap_or(1), panics)),
                None => (entry.to_owned(), (1, panics)),
            }
        })
        .collect();
    Mutex::new(armed)
});

/// Aborts the process if `name` is armed and this is the hit it waits for.
pub fn hit(name: &str) {
    let mut armed = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    if armed.is_empty() {
        return;
    }
    if let Some((left, panics)) = armed.get_mut(name) {
        *left = left.saturating_sub(1);
        if *left == 0 {
            if *panics {
                armed.remove(name);
                drop(armed);
                panic!("failpoint {name}");
            }
            eprintln!("failpoint {name}: aborting the process");
            std::process::abort();
        }
    }
}
