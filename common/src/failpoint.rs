//! Named crash points for fault-injection tests, compiled only with the `failpoints`
//! feature, which the tests' builds turn on. Without it [`hit`] is empty and inlined away: a
//! call site passes a [`Point`], a number, so no name, no lock and no symbol of this module
//! is left in the binary (`docker/test.sh` checks the shipped binaries with `nm` and
//! `strings`).
//!
//! `JOBFOLD_FAILPOINT=relay-after-produce-before-mark` makes the process abort — no
//! destructors, no flushing, like `kill -9` — the first time it reaches that point;
//! `name@3` aborts on the third time; `name:panic` (or `name@3:panic`) panics there instead,
//! as a bug in the code at that point would. Several are separated by commas. Unset, a check
//! reads one flag.

/// A place in the code where a test can crash the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// The relay produced a batch and got every delivery report, but has not marked it.
    RelayAfterProduceBeforeMark,
    /// The processor committed a lease and has not run the handler.
    ProcessorAfterLeaseCommit,
    /// The handler returned; nothing of its result is committed.
    ProcessorInHandler,
    /// The completion transaction committed; the Kafka offset is not stored yet.
    ProcessorAfterCompletionBeforeOffset,
    /// The intake committed a batch of accepted requests; their offsets are not stored yet.
    IntakeAfterCommitBeforeOffset,
    /// The processor's heartbeat task is about to beat (a crash here is the task's, not a
    /// job's: the process must not run on without it).
    ProcessorHeartbeat,
}

impl Point {
    /// The name `JOBFOLD_FAILPOINT` arms it by.
    pub const fn name(self) -> &'static str {
        match self {
            Self::RelayAfterProduceBeforeMark => "relay-after-produce-before-mark",
            Self::ProcessorAfterLeaseCommit => "processor-after-lease-commit",
            Self::ProcessorInHandler => "processor-in-handler",
            Self::ProcessorAfterCompletionBeforeOffset => {
                "processor-after-completion-before-offset-store"
            }
            Self::IntakeAfterCommitBeforeOffset => "intake-after-commit-before-offset-store",
            Self::ProcessorHeartbeat => "processor-heartbeat",
        }
    }
}

/// [`Point::RelayAfterProduceBeforeMark`]'s name.
pub const RELAY_AFTER_PRODUCE_BEFORE_MARK: &str = Point::RelayAfterProduceBeforeMark.name();
/// [`Point::ProcessorAfterLeaseCommit`]'s name.
pub const PROCESSOR_AFTER_LEASE_COMMIT: &str = Point::ProcessorAfterLeaseCommit.name();
/// [`Point::ProcessorInHandler`]'s name.
pub const PROCESSOR_IN_HANDLER: &str = Point::ProcessorInHandler.name();
/// [`Point::ProcessorAfterCompletionBeforeOffset`]'s name.
pub const PROCESSOR_AFTER_COMPLETION_BEFORE_OFFSET: &str =
    Point::ProcessorAfterCompletionBeforeOffset.name();
/// [`Point::IntakeAfterCommitBeforeOffset`]'s name.
pub const INTAKE_AFTER_COMMIT_BEFORE_OFFSET: &str = Point::IntakeAfterCommitBeforeOffset.name();
/// [`Point::ProcessorHeartbeat`]'s name.
pub const PROCESSOR_HEARTBEAT: &str = Point::ProcessorHeartbeat.name();

/// Does nothing: this build has no fault points.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_point: Point) {}

#[cfg(feature = "failpoints")]
pub use armed::{VARIABLE, hit};

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::HashMap;
    use std::sync::{LazyLock, Mutex};

    use super::Point;

    /// The variable that arms fault points.
    pub const VARIABLE: &str = "JOBFOLD_FAILPOINT";

    /// Whether any fault point is armed: read without a lock on every hit.
    static ANY: LazyLock<bool> =
        LazyLock::new(|| std::env::var(VARIABLE).is_ok_and(|s| !s.trim().is_empty()));

    /// Armed failpoints: name -> hits left before the abort (or the panic, if true).
    static ARMED: LazyLock<Mutex<HashMap<String, (u64, bool)>>> = LazyLock::new(|| {
        let spec = std::env::var(VARIABLE).unwrap_or_default();
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

    /// Aborts the process (or panics) if `point` is armed and this is the hit it waits for.
    pub fn hit(point: Point) {
        if !*ANY {
            return;
        }
        let name = point.name();
        let mut armed = ARMED.lock().unwrap_or_else(|e| e.into_inner());
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
}
