//! Panics in the code a processor runs for its users: a handler's `run`, `commit` and `cost`.
//!
//! Each such panic is already its job's failure, carrying the panic's message (see
//! docs/processor.md, "Panics"). What Rust's panic hook adds is not contained: the default
//! hook writes a report under a lock that every panicking thread of the process waits for,
//! and with `RUST_BACKTRACE` set it symbolises a backtrace while it holds it, on a tokio
//! worker (`cost` panics inside the lease path, `commit` inside the completion transaction,
//! its row locks held): about 0.1 s the first time in a debug process, then up to
//! milliseconds each, and some 130 lines of log. A kind whose handler panics on every job
//! would spend the process's time and fill its log with them (a fault campaign's 471
//! handler panics wrote 92 % of its processors' log lines).
//!
//! So [`install`] puts a hook in front of the one there before: a panic raised while user
//! code runs ([`user`], [`User`]) is counted (`jobfold_handler_panics_total{kind, call}`)
//! and logged as a warning with its kind, message and place — at most one a second — with
//! no backtrace. Every other panic, jobfold's own included, goes to the hook that was there
//! before, backtrace and all.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use crate::metrics as m;

/// Longest panic message logged, in characters.
const MESSAGE_MAX: usize = 500;

/// Which call into user code (`run`, `commit`, `cost`), and of which kind.
#[derive(Debug, Clone)]
pub struct Call {
    kind: Arc<str>,
    call: &'static str,
}

impl Call {
    #[must_use]
    pub fn new(kind: &str, call: &'static str) -> Self {
        Self { kind: kind.into(), call }
    }
}

thread_local! {
    /// The call into user code this thread is in, if any.
    static IN: RefCell<Option<Call>> = const { RefCell::new(None) };
}

/// Marks this thread as in `call` until dropped, restoring what it was in before.
struct Entered(Option<Call>);

impl Entered {
    fn enter(call: &Call) -> Self {
        Self(IN.with(|inside| inside.replace(Some(call.clone()))))
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let before = self.0.take();
        // During a thread's teardown the slot may be gone; nothing to restore then.
        let _ = IN.try_with(|inside| *inside.borrow_mut() = before);
    }
}

/// Calls `f`, user code, as `call`: a panic in it is reported as a handler's.
pub fn user<T>(call: &Call, f: impl FnOnce() -> T) -> T {
    let _entered = Entered::enter(call);
    f()
}

/// A future of user code, polled as `call`: a panic in a poll is reported as a handler's.
pub struct User<F> {
    inner: F,
    call: Call,
}

impl<F> std::fmt::Debug for User<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User").field("call", &self.call).finish_non_exhaustive()
    }
}

impl<F> User<F> {
    pub fn new(call: Call, inner: F) -> Self {
        Self { inner, call }
    }
}

impl<F: Future + Unpin> Future for User<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let _entered = Entered::enter(&this.call);
        Pin::new(&mut this.inner).poll(cx)
    }
}

/// The second (since the epoch) of the last warning logged.
static LOGGED_AT: AtomicU64 = AtomicU64::new(0);

/// Puts the hook described above in front of the present one, once per process.
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let inside = IN.try_with(|inside| inside.borrow().clone()).ok().flatten();
            match inside {
                Some(call) => report(&call, info),
                None => before(info),
            }
        }));
    });
}

fn report(call: &Call, info: &std::panic::PanicHookInfo<'_>) {
    metrics::counter!(m::HANDLER_PANICS_TOTAL, "kind" => call.kind.to_string(), "call" => call.call)
        .increment(1);
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if LOGGED_AT.swap(second, Ordering::Relaxed) == second {
        return;
    }
    let message: String =
        crate::handler::panic_message(info.payload()).chars().take(MESSAGE_MAX).collect();
    let at = info.location().map(ToString::to_string).unwrap_or_default();
    tracing::warn!(
        kind = %call.kind,
        call = call.call,
        message,
        at,
        "A handler panicked: its job's attempt fails with the panic's message (no backtrace \
         is taken for a handler's panic; at most one of these a second is logged, \
         jobfold_handler_panics_total counts them all)."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_restored_when_its_scope_ends() {
        let outer = Call::new("outer", "run");
        user(&outer, || {
            user(&Call::new("inner", "cost"), || {
                IN.with(|i| assert_eq!(i.borrow().as_ref().map(|c| c.call), Some("cost")));
            });
            IN.with(|i| assert_eq!(i.borrow().as_ref().map(|c| &*c.kind), Some("outer")));
        });
        IN.with(|i| assert!(i.borrow().is_none()));
        let unwound = std::panic::catch_unwind(|| user(&outer, || panic!("unwinds")));
        assert!(unwound.is_err());
        IN.with(|i| assert!(i.borrow().is_none(), "a panic's unwind leaves the thread marked"));
    }
}
