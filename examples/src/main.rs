//! `jobfold-examples`: a processor running the design's three jobs — `index-document`,
//! `summarize-conversation` and `convert-audio` —, the trivial `noop` and every kind its configuration names a
//! URL for (`[kinds.<kind>] url`, such as `examples/python/worker.py`).
//!
//! ```sh
//! jobfold-examples --model-url http://127.0.0.1:8090/v1/chat/completions \
//!     --audio-input /srv/audio/in --audio-output /srv/audio/out
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use jobfold_common::config::{self, Config};
use jobfold_common::{db, shutdown, telemetry};
use jobfold_examples::{audio, index, noop, summarize};

/// Runs the example jobs.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// TOML configuration file; JOBFOLD_* environment variables override it.
    #[arg(long, env = "JOBFOLD_CONFIG")]
    config: Option<PathBuf>,
    /// summarize-conversation's model server: an OpenAI-compatible chat completions URL.
    #[arg(
        long,
        env = "SUMMARIZE_MODEL_URL",
        default_value = "http://127.0.0.1:8090/v1/chat/completions"
    )]
    model_url: String,
    /// The model it asks for.
    #[arg(long, env = "SUMMARIZE_MODEL", default_value = "local")]
    model: String,
    /// How long one model call may take.
    #[arg(long, default_value = "2min", value_parser = humantime::parse_duration)]
    model_timeout: Duration,
    /// convert-audio reads its sources below this directory.
    #[arg(long, env = "AUDIO_INPUT_DIR", default_value = "audio/in")]
    audio_input: PathBuf,
    /// convert-audio writes its conversions here.
    #[arg(long, env = "AUDIO_OUTPUT_DIR", default_value = "audio/out")]
    audio_output: PathBuf,
    /// The sox program.
    #[arg(long, env = "SOX", default_value = "sox")]
    sox: PathBuf,
    /// How long one conversion may take.
    #[arg(long, default_value = "10min", value_parser = humantime::parse_duration)]
    audio_timeout: Duration,
}

// glibc's allocator in two arenas, not mimalloc: a processor's memory is mostly its jobs in
// flight, and an HTTP call in flight held 43 KiB under mimalloc against 26 KiB under glibc
// (1,000 concurrent reqwest calls, measured), which put a processor running 1,000 slow jobs
// over its 64 MiB (BENCHMARKS.md).
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    telemetry::at_most_two_malloc_arenas();
    telemetry::no_transparent_huge_pages();
    let args = Args::parse();
    let config = Config::load_or_exit("jobfold-examples", args.config.as_deref());
    telemetry::init_tracing(config.log_json);
    telemetry::install_metrics(config.metrics_addr)?;
    let summarize = summarize::Summarize::new(&args.model_url, args.model, args.model_timeout)?;
    let audio =
        audio::ConvertAudio::new(args.audio_input, args.audio_output, args.sox, args.audio_timeout);
    let run = async {
        // The examples' tables, before any job of theirs runs.
        let pool = db::connect(&config, 1).await?;
        jobfold_examples::migrate(&pool).await?;
        pool.close().await;
        jobfold_processor::Processor::builder(config)
            .handler(index::KIND, index::IndexDocument)
            .handler(summarize::KIND, summarize)
            .handler(audio::KIND, audio)
            .handler(noop::KIND, noop::Noop)
            .run(shutdown::on_signal())
            .await
    };
    config::exit_on_config_error("jobfold-examples", run.await)
}
