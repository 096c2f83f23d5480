//! Group commit: many tasks hand one item each to a batcher, whose tasks process whatever
//! is waiting at once (up to a maximum) in one go and answer each.
//!
//! No item waits for a batch to fill: a lone item is processed at once, and items arriving
//! while a batch runs form the next one. So under load the batches grow by themselves, and
//! at rest nothing is added to an item's latency.

use std::future::Future;
use std::sync::Arc;

use crate::metrics as pm;
use futures::FutureExt;
use tokio::sync::{Mutex, mpsc, oneshot};

type Reply<R> = oneshot::Sender<anyhow::Result<R>>;

/// Hands items to the batching task.
pub struct Batcher<T, R> {
    requests: mpsc::Sender<(T, Reply<R>)>,
}

impl<T, R> Clone for Batcher<T, R> {
    fn clone(&self) -> Self {
        Self { requests: self.requests.clone() }
    }
}

impl<T, R> std::fmt::Debug for Batcher<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    /// Starts `workers` tasks that call `process` on batches of up to `max` items; `process`
    /// answers each item, in order. While a worker processes a batch, the next one takes
    /// what has arrived since, so up to `workers` batches run at once (a slow batch — slow
    /// business writes, a lock wait — does not hold up the rest). `name` labels the batch
    /// size histogram ([`pm::TRANSACTION_JOBS`]). The tasks run in `work`, and end when every
    /// clone of the batcher is dropped.
    pub fn start<F, Fut>(
        name: &'static str,
        max: usize,
        workers: usize,
        work: &crate::supervise::Work,
        process: F,
    ) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Vec<anyhow::Result<R>>> + Send,
    {
        let (requests, receiver) = mpsc::channel::<(T, Reply<R>)>(max * workers.max(1) * 2);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..workers.max(1) {
            let (receiver, process) = (Arc::clone(&receiver), process.clone());
            work.spawn(name, async move {
                let mut batch = Vec::with_capacity(max);
                loop {
                    // The lock is held only while waiting for the batch, not while it runs.
                    if receiver.lock().await.recv_many(&mut batch, max).await == 0 {
                        return;
                    }
                    let (items, replies): (Vec<T>, Vec<Reply<R>>) = batch.drain(..).unzip();
                    metrics::histogram!(pm::TRANSACTION_JOBS, "transaction" => name)
                        .record(items.len() as f64);
                    // A panic while processing (user code is contained where it is called;
                    // this is the last net) fails this batch's items, each told why, and the
                    // task goes on with the next batch: no later item meets a stopped task.
                    let n = items.len();
                    let answers = match std::panic::AssertUnwindSafe(process(items))
                        .catch_unwind()
                        .await
                    {
                        Ok(answers) => answers,
                        Err(panic) => {
                            let message = crate::handler::panic_message(panic.as_ref());
                            tracing::error!(batcher = name, panic = %message, "A batch panicked; its items fail and the batcher goes on.");
                            each_failed(n, &anyhow::anyhow!("the {name} batch panicked: {message}"))
                        }
                    };
                    debug_assert_eq!(answers.len(), replies.len());
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
            });
        }
        Self { requests }
    }

    /// Processes `item` with whatever else is waiting and returns its answer.
    ///
    /// # Errors
    /// Processing failed for this item (or the task stopped).
    pub async fn submit(&self, item: T) -> anyhow::Result<R> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send((item, reply))
            .await
            .map_err(|_| anyhow::anyhow!("the batching task has stopped"))?;
        answer.await.map_err(|_| anyhow::anyhow!("the batching task has stopped"))?
    }
}

/// The same error for each of `n` items of a batch that failed as a whole.
pub fn each_failed<R>(n: usize, error: &anyhow::Error) -> Vec<anyhow::Result<R>> {
    (0..n).map(|_| Err(anyhow::anyhow!("{error:#}"))).collect()
}
