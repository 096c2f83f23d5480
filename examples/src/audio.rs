//! `convert-audio`: converts a sound file with `sox`, run as a subprocess, and keeps where
//! each document's converted audio is, with its SHA-256, in `audio_conversions`.
//!
//! Input: `{"source": "calls/42.wav", "format": "flac", "rate": 16000}`: `source` is a path
//! under the handler's input directory (absolute paths and `..` are invalid input), `format`
//! one of `wav`, `flac`, `ogg`, `rate` (optional) the sample rate in Hz; the output is mono.
//!
//! The conversion writes `<job id>-v<input version>.<format>` in the output directory, first
//! under a temporary name, then synced and renamed: a crash leaves no half file under the
//! final name, and a repeated attempt writes the same file again. `sox` is killed when the run
//! is cancelled (lost lease, shutdown, the kind's `run_timeout`) or takes longer than the
//! handler's own time-out. The path and checksum commit in the completion transaction.

use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use jobfold_processor::handler::{Committed, Handler, HandlerError, JobContext};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

/// The job kind this handler runs.
pub const KIND: &str = "convert-audio";

/// The formats it writes.
pub const FORMATS: [&str; 3] = ["wav", "flac", "ogg"];

/// Conversions with `sox` from one directory into another.
#[derive(Debug, Clone)]
pub struct ConvertAudio {
    input_dir: PathBuf,
    output_dir: PathBuf,
    program: PathBuf,
    timeout: Duration,
}

/// What one job asks for.
#[derive(Debug)]
struct Request {
    source: PathBuf,
    format: &'static str,
    rate: Option<u32>,
}

impl ConvertAudio {
    /// Reads sources under `input_dir`, writes into `output_dir` (created if missing) with
    /// the `sox` at `program`; one conversion may take `timeout`.
    pub fn new(
        input_dir: impl Into<PathBuf>,
        output_dir: impl Into<PathBuf>,
        program: impl Into<PathBuf>,
        timeout: Duration,
    ) -> Self {
        Self {
            input_dir: input_dir.into(),
            output_dir: output_dir.into(),
            program: program.into(),
            timeout,
        }
    }

    fn request(&self, input: &Value) -> Result<Request, HandlerError> {
        let source = input
            .get("source")
            .and_then(Value::as_str)
            .ok_or_else(|| HandlerError::invalid_input("input.source must be a string"))?;
        let relative = Path::new(source);
        if source.is_empty() || !relative.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(HandlerError::invalid_input(
                "input.source must be a relative path below the input directory, without ..",
            ));
        }
        let format = input.get("format").and_then(Value::as_str).unwrap_or("flac");
        let format = FORMATS.into_iter().find(|f| *f == format).ok_or_else(|| {
            HandlerError::invalid_input(format!("input.format must be one of {FORMATS:?}"))
        })?;
        let rate = match input.get("rate") {
            None | Some(Value::Null) => None,
            Some(rate) => Some(
                rate.as_u64()
                    .and_then(|r| u32::try_from(r).ok())
                    .filter(|r| (1_000..=384_000).contains(r))
                    .ok_or_else(|| {
                        HandlerError::invalid_input("input.rate must be 1000 to 384000 (Hz)")
                    })?,
            ),
        };
        Ok(Request { source: self.input_dir.join(relative), format, rate })
    }

    /// Runs `sox` into `partial`; killed if cancelled or past the time-out.
    async fn convert(
        &self,
        request: &Request,
        partial: &Path,
        cancel: &CancellationToken,
    ) -> Result<(), HandlerError> {
        let mut command = tokio::process::Command::new(&self.program);
        command.arg("--no-show-progress").arg(&request.source).args(["-t", request.format]);
        if let Some(rate) = request.rate {
            command.args(["-r", &rate.to_string()]);
        }
        command.args(["-c", "1"]).arg(partial);
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            // Dropped (cancelled, timed out, the run dropped): the process is killed.
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                HandlerError::retryable(format!("starting {}: {e}", self.program.display()))
            })?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let finished = async {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            (child.wait().await, text)
        };
        let (status, stderr) = tokio::select! {
            _ = cancel.cancelled() => {
                return Err(HandlerError::retryable("cancelled: sox was stopped"));
            }
            _ = tokio::time::sleep(self.timeout) => {
                return Err(HandlerError::retryable(format!(
                    "sox ran longer than {:?} and was stopped",
                    self.timeout
                )));
            }
            finished = finished => finished,
        };
        let status =
            status.map_err(|e| HandlerError::retryable(format!("waiting for sox: {e}")))?;
        match status.code() {
            Some(0) => Ok(()),
            // sox: 1 is a problem with the command line or the input file; 2 one while
            // converting (also the input's).
            Some(_) => Err(HandlerError::invalid_input(format!(
                "sox could not convert {}: {}",
                request.source.display(),
                stderr.trim()
            ))),
            None => Err(HandlerError::retryable(format!("sox was killed: {status}"))),
        }
    }
}

impl Handler for ConvertAudio {
    async fn run(
        &self,
        job: &JobContext,
        cancel: CancellationToken,
    ) -> Result<Value, HandlerError> {
        let request = self.request(&job.input)?;
        if !request.source.is_file() {
            return Err(HandlerError::invalid_input(format!(
                "input.source: no file {}",
                request.source.display()
            )));
        }
        let io = |what: &str, e: std::io::Error| HandlerError::retryable(format!("{what}: {e}"));
        tokio::fs::create_dir_all(&self.output_dir)
            .await
            .map_err(|e| io("creating the output directory", e))?;
        let name = format!("{}-v{}.{}", job.job_id, job.input_version, request.format);
        let target = self.output_dir.join(&name);
        // One temporary name per attempt: a zombie attempt never writes into this one's file.
        let partial = self.output_dir.join(format!(".{name}.{}.part", job.generation));
        let converted = self.convert(&request, &partial, &cancel).await;
        if let Err(e) = converted {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(e);
        }
        let bytes = tokio::fs::read(&partial).await.map_err(|e| io("reading the conversion", e))?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        // Durable before it is named: sync the file, rename it, sync the directory.
        let file = tokio::fs::File::open(&partial).await.map_err(|e| io("opening", e))?;
        file.sync_all().await.map_err(|e| io("syncing the conversion", e))?;
        tokio::fs::rename(&partial, &target).await.map_err(|e| io("renaming the conversion", e))?;
        let dir = tokio::fs::File::open(&self.output_dir).await.map_err(|e| io("opening", e))?;
        dir.sync_all().await.map_err(|e| io("syncing the output directory", e))?;
        Ok(json!({
            "path": target.display().to_string(),
            "sha256": sha256,
            "bytes": bytes.len(),
            "format": request.format,
        }))
    }

    async fn commit(
        &self,
        tx: &mut PgConnection,
        job: &JobContext,
        output: &Value,
    ) -> Result<Committed, sqlx::Error> {
        let written = sqlx::query!(
            r#"
            INSERT INTO audio_conversions (document_id, version, path, sha256, bytes, job_id)
            VALUES ($1, $2, $3, $4, $5, $6)
            ON CONFLICT (document_id) DO UPDATE
                SET version = EXCLUDED.version, path = EXCLUDED.path, sha256 = EXCLUDED.sha256,
                    bytes = EXCLUDED.bytes, job_id = EXCLUDED.job_id, updated_at = now()
                WHERE audio_conversions.version <= EXCLUDED.version
            "#,
            &job.document_id,
            job.input_version,
            output["path"].as_str().unwrap_or_default(),
            output["sha256"].as_str().unwrap_or_default(),
            output["bytes"].as_i64().unwrap_or_default(),
            job.job_id,
        )
        .execute(&mut *tx)
        .await?;
        let newer = sqlx::query_scalar!(
            "SELECT version FROM audio_conversions WHERE document_id = $1",
            &job.document_id
        )
        .fetch_one(&mut *tx);
        crate::applied_or_stale(written.rows_affected(), newer).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_stay_inside_the_input_directory() {
        let handler = ConvertAudio::new("/in", "/out", "sox", Duration::from_secs(1));
        let ok = handler.request(&json!({"source": "a/b.wav", "format": "ogg"})).unwrap();
        assert_eq!(ok.source, Path::new("/in/a/b.wav"));
        for bad in [
            json!({"source": "/etc/passwd"}),
            json!({"source": "../x.wav"}),
            json!({"source": "a/../../x.wav"}),
            json!({"source": "a.wav", "format": "exe"}),
            json!({"source": "a.wav", "rate": 5}),
            json!({}),
        ] {
            assert!(handler.request(&bad).is_err(), "{bad}");
        }
    }
}
