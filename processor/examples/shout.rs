//! A processor of your own: one kind of job, `shout`, in about thirty lines.
//!
//! ```sh
//! cargo run -p jobfold-processor --example shout
//! ```
//!
//! It takes the same configuration as `jobfold-processor` (defaults, `--config`-less here,
//! `JOBFOLD_*` variables) and serves the same HTTP API; submit with
//! `{"kind": "shout", "input": {"text": "hello"}, ...}`.

// The handler API is its own crate, `jobfold-handler`; the processor only runs it.
use jobfold_handler::{Handler, HandlerError, JobContext};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Upper-cases `input.text`.
struct Shout;

impl Handler for Shout {
    // Runs outside any transaction; `cancel` fires on a lost lease or shutdown.
    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        let text = job.input["text"]
            .as_str()
            .ok_or_else(|| HandlerError::invalid_input("input.text must be a string"))?;
        if cancel.is_cancelled() {
            return Err(HandlerError::retryable("cancelled"));
        }
        Ok(json!({ "shouted": text.to_uppercase() }))
    }
    // `commit` (optional) writes business rows inside the fenced completion transaction.
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = jobfold_common::config::Config::load_or_exit("shout", None);
    jobfold_common::telemetry::init_tracing(config.log_json);
    jobfold_processor::Processor::builder(config)
        .handler("shout", Shout)
        .run(jobfold_common::shutdown::on_signal())
        .await
}
