//! The worker's tasks, every one owned and joined.
//!
//! - [`Tasks`]: the background tasks that run as long as the worker does (the reaper,
//!   retention, the dispatcher, the heartbeat, the quota poll). One that ends before the
//!   shutdown — it returned, or panicked — is never left for the rest to retry against: the
//!   worker fails, naming it, so the whole process stops (exit non-zero) and is restarted by
//!   whatever runs it, its leases left to expire and its partitions to move.
//! - [`Work`]: the tasks started as work comes, each ending on its own (a document's next
//!   message, a batcher's turn, the look for callback outcomes, an accept's commit). They are
//!   tracked, so their owner waits for them when it stops ([`Work::join`], bounded); and one
//!   that panics is reported to its [`Tasks`] as a background task's end is, for a panic
//!   there leaves its document or batch behind for good.

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::task::TaskTracker;

use crate::metrics as pm;

/// How a supervised task ended: its name, and the panic's message if it panicked.
type Ended = (&'static str, Result<(), String>);

/// Tasks that must run as long as their owner, and the work tasks whose panics they report.
pub struct Tasks {
    set: JoinSet<Ended>,
    /// What the owner's [`Work`] says of the work tasks that panicked.
    panics: mpsc::UnboundedReceiver<Ended>,
    work: Work,
}

impl Default for Tasks {
    fn default() -> Self {
        let (report, panics) = mpsc::unbounded_channel();
        Self {
            set: JoinSet::new(),
            panics,
            work: Work { tracker: TaskTracker::new(), report: Some(report) },
        }
    }
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks").field("running", &self.set.len()).field("work", &self.work).finish()
    }
}

impl Tasks {
    /// Runs `task` as `name`.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.set.spawn(async move {
            let ended = std::panic::AssertUnwindSafe(task).catch_unwind().await;
            (name, ended.map_err(|panic| crate::handler::panic_message(panic.as_ref())))
        });
    }

    /// Where the owner starts its work tasks: a panic of one ends [`Tasks::ended`].
    pub fn work(&self) -> Work {
        self.work.clone()
    }

    /// Waits until one of the tasks ends or a work task panics (never, if neither happens)
    /// and says which and how.
    pub async fn ended(&mut self) -> anyhow::Error {
        let ended = tokio::select! {
            joined = self.set.join_next(), if !self.set.is_empty() => match joined {
                Some(Ok(ended)) => ended,
                Some(Err(e)) => ("a task", Err(e.to_string())),
                None => std::future::pending().await,
            },
            // Never closed: this holds a sender of its own (in `work`).
            Some(panicked) = self.panics.recv() => panicked,
            else => std::future::pending().await,
        };
        let (name, how) = ended;
        metrics::counter!(pm::TASK_FAILURES_TOTAL, "task" => name).increment(1);
        match how {
            Ok(()) => anyhow::anyhow!("the {name} task ended while the worker ran"),
            Err(panic) => anyhow::anyhow!("the {name} task panicked: {panic}"),
        }
    }

    /// Stops every background task (after the shutdown; what they write is transactional, so
    /// a task stopped mid-way leaves nothing half done) and waits until they are gone. The
    /// work tasks are the owner's to join: they end once what they serve is dropped.
    pub async fn stop(mut self) {
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
    }
}

/// Tasks started as work comes, each ending on its own; cloned, the same set.
#[derive(Clone, Debug, Default)]
pub struct Work {
    tracker: TaskTracker,
    /// Where a panic is reported ([`Tasks::work`]); none: the panic is the caller's, through
    /// the task's handle.
    report: Option<mpsc::UnboundedSender<Ended>>,
}

/// How long a stopping owner waits for its work tasks to end before it goes on without
/// them (and says how many were left).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

impl Work {
    /// Runs `task` as `name`, tracked. A panic is reported (if this set reports panics) and
    /// then goes on to the returned handle, as it would untracked.
    pub fn spawn<T: Send + 'static>(
        &self,
        name: &'static str,
        task: impl Future<Output = T> + Send + 'static,
    ) -> JoinHandle<T> {
        let report = self.report.clone();
        self.tracker.spawn(async move {
            match std::panic::AssertUnwindSafe(task).catch_unwind().await {
                Ok(done) => done,
                Err(panic) => {
                    let message = crate::handler::panic_message(panic.as_ref());
                    tracing::error!(task = name, panic = %message, "A work task panicked.");
                    if let Some(report) = report {
                        let _ = report.send((name, Err(message)));
                    }
                    std::panic::resume_unwind(panic)
                }
            }
        })
    }

    /// The tasks still running.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }

    /// Takes no more tasks and waits, up to `within`, for the running ones to end; `owner`
    /// names who waits in the warning if some are left. True if all ended.
    pub async fn join(&self, owner: &str, within: Duration) -> bool {
        self.tracker.close();
        if tokio::time::timeout(within, self.tracker.wait()).await.is_ok() {
            return true;
        }
        tracing::warn!(
            owner,
            left = self.tracker.len(),
            waited = ?within,
            "Stopping without waiting longer for its tasks; they end with the process."
        );
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicked_work_task_ends_the_owner_and_its_handle_sees_the_panic() {
        let mut tasks = Tasks::default();
        let work = tasks.work();
        let handle = work.spawn("document", async { panic!("bookkeeping broke") });
        let ended = tasks.ended().await.to_string();
        assert_eq!(ended, "the document task panicked: bookkeeping broke");
        assert!(handle.await.unwrap_err().is_panic());
    }

    #[tokio::test]
    async fn join_waits_for_the_tasks_running_and_then_takes_no_more() {
        let work = Work::default();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
        work.spawn("batch", async move {
            released.await.unwrap();
            done.send(()).unwrap();
        });
        assert_eq!(work.running(), 1);
        let joining = tokio::spawn({
            let work = work.clone();
            async move { work.join("test", Duration::from_secs(60)).await }
        });
        release.send(()).unwrap();
        assert!(joining.await.unwrap(), "every task ended within the bound");
        // It had ended when the join returned, not after.
        assert_eq!(finished.try_recv(), Ok(()));
        assert_eq!(work.running(), 0);
    }

    #[tokio::test]
    async fn join_gives_up_after_its_bound_and_says_a_task_is_left() {
        let work = Work::default();
        work.spawn("stuck", std::future::pending::<()>());
        // It never ends: the join's answer does not depend on how long the bound is.
        assert!(!work.join("test", Duration::from_millis(50)).await);
        assert_eq!(work.running(), 1);
    }
}
