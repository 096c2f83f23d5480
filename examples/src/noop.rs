//! The trivial job, `noop`: does nothing and writes no business table — what River's and
//! graphile-worker's benchmarks run, so `jobfold bench` measures jobfold's own cost per job
//! with it. Its result is `null`; its input is not read.

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use jobfold_processor::handler::{Handler, HandlerError, JobContext};

/// The job kind this handler runs.
pub const KIND: &str = "noop";

/// Succeeds at once.
#[derive(Debug, Default, Clone, Copy)]
pub struct Noop;

impl Handler for Noop {
    async fn run(
        &self,
        _job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        Ok(Value::Null)
    }
}
