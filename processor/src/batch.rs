//! Group commit: many tasks hand one item each to a batcher, whose tasks process whatever
//! is waiting at once (up to a maximum) in one go and answer each.
//!
//! No item waits for a batch to fill: a lone item is processed at once, and items arriving
//! while a batch runs form the next one. So under load the batches grow by themselves, and
//! at rest nothing is added to an item's latency.
//!
//! A batcher may also [gather](Gather) its items, for callers that each wait for their
//! answer before they send again (HTTP clients on keep-alive connections). Taken as they
//! come, such callers split into cohorts: while one batch commits, the next takes the first
//! caller back alone, and two small transactions overlap where one large one would do.
//! Gathering, a batch waits for the one before to end (unless it runs longer than
//! `overtake`: a lock wait, a slow commit), then, as Postgres's `commit_delay` does, for up
//! to `linger` until it has as many items as the larger of the two before.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::metrics as pm;
use futures::FutureExt;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

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
        Self::gathering(name, max, workers, None, work, process)
    }

    /// [`Batcher::start`], with each batch gathered as `gather` says (none: taken as the
    /// items come).
    pub fn gathering<F, Fut>(
        name: &'static str,
        max: usize,
        workers: usize,
        gather: Option<Gather>,
        work: &crate::supervise::Work,
        process: F,
    ) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Vec<anyhow::Result<R>>> + Send,
    {
        let (requests, receiver) = mpsc::channel::<(T, Reply<R>)>(max * workers.max(1) * 2);
        let receiver = Arc::new(Mutex::new(receiver));
        let pace = Arc::new(Pace { sizes: AtomicU64::new(1), lane: Arc::new(Semaphore::new(1)) });
        for _ in 0..workers.max(1) {
            let (receiver, process, pace) =
                (Arc::clone(&receiver), process.clone(), Arc::clone(&pace));
            work.spawn(name, async move {
                let mut batch = Vec::with_capacity(max);
                loop {
                    // The lock is held only while waiting for the batch, not while it runs.
                    let mut waiting = receiver.lock().await;
                    if waiting.recv_many(&mut batch, max).await == 0 {
                        return;
                    }
                    let _lane = match gather {
                        Some(gather) => pace.gather(gather, &mut waiting, &mut batch, max).await,
                        None => None,
                    };
                    drop(waiting);
                    pace.taken(batch.len());
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

/// How a gathering batcher forms its batches ([`Batcher::gathering`]).
#[derive(Debug, Clone, Copy)]
pub struct Gather {
    /// How long a batch with fewer items than the larger of the two before waits for as
    /// many.
    pub linger: Duration,
    /// How long a batch waits for the one running before it: past that, it runs beside it.
    pub overtake: Duration,
}

/// What a gathering batcher's workers share.
struct Pace {
    /// The sizes of the last two batches taken, by any worker (the older one in the high
    /// half): the larger is how many callers there are. Two, as callers taken as they came
    /// form two cohorts, and a batch of the smaller one waits for the larger one's callers.
    sizes: AtomicU64,
    /// Held by the batch running in turn (one at a time, unless one overtakes).
    lane: Arc<Semaphore>,
}

impl Pace {
    /// A batch of `n` items was taken.
    fn taken(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX).min(u64::from(u32::MAX));
        let _ = self
            .sizes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sizes| Some((sizes << 32) | n));
    }

    /// How many items a batch waits for: the larger of the last two batches.
    fn callers(&self) -> usize {
        let sizes = self.sizes.load(Ordering::Relaxed);
        usize::try_from((sizes >> 32).max(sizes & u64::from(u32::MAX))).unwrap_or(usize::MAX)
    }

    /// Waits for the batch running before this one (up to `overtake`), then up to `linger`
    /// until `batch` holds as many items as [`Pace::callers`] (at most `max`); returns the
    /// lane's permit, if this batch runs in turn.
    async fn gather<T>(
        &self,
        gather: Gather,
        waiting: &mut mpsc::Receiver<T>,
        batch: &mut Vec<T>,
        max: usize,
    ) -> Option<OwnedSemaphorePermit> {
        let lane = tokio::time::timeout(gather.overtake, Arc::clone(&self.lane).acquire_owned())
            .await
            .ok()
            .and_then(Result::ok);
        let want = self.callers().min(max);
        let until = tokio::time::Instant::now() + gather.linger;
        while batch.len() < want {
            let room = want - batch.len();
            match tokio::time::timeout_at(until, waiting.recv_many(batch, room)).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        // And whatever else already waits.
        while batch.len() < max {
            match waiting.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        lane
    }
}

/// The same error for each of `n` items of a batch that failed as a whole.
pub fn each_failed<R>(n: usize, error: &anyhow::Error) -> Vec<anyhow::Result<R>> {
    (0..n).map(|_| Err(anyhow::anyhow!("{error:#}"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// A batcher whose batches are recorded (their sizes) and answered with their items.
    fn recording(gather: Option<Gather>) -> (Batcher<u32, u32>, Arc<StdMutex<Vec<usize>>>) {
        let sizes = Arc::new(StdMutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let batcher = Batcher::gathering(
            "test",
            1000,
            2,
            gather,
            &crate::supervise::Work::default(),
            move |items: Vec<u32>| {
                seen.lock().unwrap().push(items.len());
                async move { items.into_iter().map(Ok).collect() }
            },
        );
        (batcher, sizes)
    }

    /// 24 callers, each sending again once answered, until `batches` batches have run;
    /// their sizes.
    async fn closed_loop(gather: Option<Gather>, batches: usize) -> Vec<usize> {
        let (batcher, sizes) = recording(gather);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Every caller running before the first sends (spawned tasks start at their pace).
        let ready = Arc::new(tokio::sync::Barrier::new(24));
        for caller in 0..24u32 {
            let (batcher, stop, ready) = (batcher.clone(), Arc::clone(&stop), Arc::clone(&ready));
            tokio::spawn(async move {
                ready.wait().await;
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(batcher.submit(caller).await.unwrap(), caller);
                }
            });
        }
        while sizes.lock().unwrap().len() < batches {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let sizes = sizes.lock().unwrap();
        sizes[..batches].to_vec()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gathered_batches_hold_every_caller_waiting_in_turn() {
        // A linger far longer than the callers take to send again: only the count ends it.
        let gather = Gather { linger: Duration::from_secs(5), overtake: Duration::from_secs(5) };
        let sizes = closed_loop(Some(gather), 80).await;
        // The callers start one by one; once every caller waits, each batch holds all of
        // them (taken as they come, the same callers split into smaller batches).
        let settled = sizes.iter().position(|n| *n == 24);
        let settled = settled.unwrap_or_else(|| panic!("no batch of every caller: {sizes:?}"));
        assert!(settled < 40, "{sizes:?}");
        assert!(sizes[settled..].iter().all(|n| *n == 24), "{sizes:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_item_waits_for_no_linger_and_a_stuck_batch_is_overtaken() {
        // A linger of an hour: a lone item (the batch before held one) must not wait for it.
        let gather =
            Gather { linger: Duration::from_secs(3600), overtake: Duration::from_millis(50) };
        let (release, released) = tokio::sync::watch::channel(false);
        let started = Arc::new(tokio::sync::Notify::new());
        let batcher = Batcher::gathering(
            "test",
            1000,
            2,
            Some(gather),
            &crate::supervise::Work::default(),
            {
                let started = Arc::clone(&started);
                move |items: Vec<u32>| {
                    let (mut released, started) = (released.clone(), Arc::clone(&started));
                    async move {
                        // Item 0's batch is stuck (a lock wait) until released.
                        if items.contains(&0) {
                            started.notify_one();
                            let _ = released.wait_for(|r| *r).await;
                        }
                        items.into_iter().map(Ok).collect()
                    }
                }
            },
        );
        let stuck = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.submit(0).await.unwrap() }
        });
        started.notified().await;
        // The next item runs beside the stuck batch once it has run past `overtake`, and is
        // answered while that batch still waits.
        let within = Duration::from_secs(60);
        let answer = tokio::time::timeout(within, batcher.submit(1)).await;
        assert_eq!(answer.expect("the stuck batch was overtaken").unwrap(), 1);
        assert!(!stuck.is_finished());
        release.send(true).unwrap();
        assert_eq!(stuck.await.unwrap(), 0);
    }
}
