//! Process shutdown: one root token, cancelled by SIGINT or SIGTERM.
//!
//! The first signal starts a graceful stop (finish the batch in flight, commit, exit); a
//! second one exits at once with status 130.

use tokio_util::sync::CancellationToken;

/// A token cancelled by the first SIGINT or SIGTERM; the second exits the process.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("Shutting down: finishing work in flight (signal again to exit now).");
        cancel.cancel();
        wait_for_signal().await;
        tracing::warn!("Second signal: exiting now.");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
