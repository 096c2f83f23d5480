//! The kinds an operator paused ([`crate::store::kinds`]), as this processor last read them.
//!
//! Read once before the processor consumes anything, then once a [`POLL`]: a pause takes
//! effect in every processor within a second. The cache only says when to ask: a dispatch
//! of a kind it holds paused is passed over only if the pause row is there when the job is
//! noted ([`crate::store::kinds::pass_over`]), so a resume never strands a job.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::metrics as pm;

/// How often a processor reads the pauses.
pub const POLL: Duration = Duration::from_secs(1);

/// The paused kinds, as last read.
#[derive(Debug)]
pub struct Pauses {
    pool: PgPool,
    /// The kinds this processor runs, for the gauge.
    kinds: Vec<String>,
    paused: Mutex<HashSet<String>>,
}

impl Pauses {
    /// Reads the pauses once.
    ///
    /// # Errors
    /// The database failed: the processor does not start without knowing them.
    pub async fn load(pool: PgPool, kinds: Vec<String>) -> Result<Self, sqlx::Error> {
        let pauses = Self { pool, kinds, paused: Mutex::default() };
        pauses.read().await?;
        Ok(pauses)
    }

    /// Whether `kind` was paused when last read.
    pub fn holds(&self, kind: &str) -> bool {
        self.paused.lock().expect("paused").contains(kind)
    }

    async fn read(&self) -> Result<(), sqlx::Error> {
        let now: HashSet<String> = sqlx::query_scalar!("SELECT kind FROM kind_pauses")
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .collect();
        let mut paused = self.paused.lock().expect("paused");
        for kind in now.difference(&paused) {
            tracing::info!(kind, "Kind paused: its dispatches are passed over until it resumes.");
        }
        for kind in paused.difference(&now) {
            tracing::info!(kind, "Kind resumed.");
        }
        for kind in &self.kinds {
            let on = if now.contains(kind) { 1.0 } else { 0.0 };
            metrics::gauge!(pm::KIND_PAUSED, "kind" => kind.clone()).set(on);
        }
        *paused = now;
        Ok(())
    }

    /// Reads the pauses once a [`POLL`] until `shutdown`; a failed read keeps the last.
    pub async fn poll(self: std::sync::Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(POLL) => {}
            }
            if let Err(e) = self.read().await {
                tracing::debug!(error = %e, "Reading the paused kinds failed.");
            }
        }
    }
}
