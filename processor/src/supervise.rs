//! The worker's background tasks, supervised: the reaper, retention, the dispatcher, the
//! heartbeat and the quota poll run as long as the worker does. One that ends before the
//! shutdown — it returned, or panicked — is never left for the rest to retry against: the
//! worker fails, naming it, so the whole process stops (exit non-zero) and is restarted by
//! whatever runs it, its leases left to expire and its partitions to move.

use std::future::Future;

use futures::FutureExt;
use tokio::task::JoinSet;

use crate::metrics as pm;

/// How a supervised task ended: its name, and the panic's message if it panicked.
type Ended = (&'static str, Result<(), String>);

/// Tasks that must run as long as their owner.
#[derive(Default)]
pub struct Tasks {
    set: JoinSet<Ended>,
}

impl std::fmt::Debug for Tasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tasks").field("running", &self.set.len()).finish()
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

    /// Waits until one of the tasks ends (never, if there are none) and says which and how.
    pub async fn ended(&mut self) -> anyhow::Error {
        let ended = match self.set.join_next().await {
            Some(Ok(ended)) => ended,
            Some(Err(e)) => ("a task", Err(e.to_string())),
            None => std::future::pending().await,
        };
        let (name, how) = ended;
        metrics::counter!(pm::TASK_FAILURES_TOTAL, "task" => name).increment(1);
        match how {
            Ok(()) => anyhow::anyhow!("the {name} task ended while the worker ran"),
            Err(panic) => anyhow::anyhow!("the {name} task panicked: {panic}"),
        }
    }

    /// Stops every task (after the shutdown; what they write is transactional, so a task
    /// stopped mid-way leaves nothing half done) and waits until they are gone.
    pub async fn stop(mut self) {
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
    }
}
