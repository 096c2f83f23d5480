//! Group commit: many tasks hand one item each to a batcher, whose task processes whatever
//! is waiting at once (up to a maximum) in one go and answers each.
//!
//! No item waits for a batch to fill: a lone item is processed at once, and items arriving
//! while a batch runs form the next one. So under load the batches grow by themselves, and
//! at rest nothing is added to an item's latency.

use std::future::Future;

use jobfold_common::metrics as pm;
use tokio::sync::{mpsc, oneshot};

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
    /// Starts the task that calls `process` on batches of up to `max` items; `process`
    /// answers each item, in order. `name` labels the batch size histogram
    /// ([`pm::TRANSACTION_JOBS`]). The task ends when every clone of the batcher is dropped.
    pub fn start<F, Fut>(name: &'static str, max: usize, process: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<anyhow::Result<R>>> + Send,
    {
        let (requests, mut receiver) = mpsc::channel::<(T, Reply<R>)>(max * 4);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(max);
            while receiver.recv_many(&mut batch, max).await > 0 {
                let (items, replies): (Vec<T>, Vec<Reply<R>>) = batch.drain(..).unzip();
                metrics::histogram!(pm::TRANSACTION_JOBS, "transaction" => name)
                    .record(items.len() as f64);
                let answers = process(items).await;
                debug_assert_eq!(answers.len(), replies.len());
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(answer);
                }
            }
        });
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
