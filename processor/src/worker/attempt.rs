//! One message to its end: lease, the handler's run (time-out, panic, cancel, heartbeats),
//! completion, and what is set aside.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A dispatch waiting for another worker's live lease looks again after this, doubling up
/// to [`LOOK_AGAIN_MAX`] (or at the lease's end, if sooner).
pub(super) const LOOK_AGAIN_MIN: Duration = Duration::from_millis(250);

pub(super) const LOOK_AGAIN_MAX: Duration = Duration::from_secs(8);

/// Handles one message to the end, starting in the process's slot `permit`. False if it
/// was left unfinished (shutdown or revoke): its offset must not be stored. While it waits
/// to try again (no handler here, another worker's live lease, an error) it holds no slot.
pub(super) async fn handle(
    shared: &Shared,
    message: &Held,
    ticket: &Ticket,
    mut permit: Option<OwnedSemaphorePermit>,
) -> bool {
    let mut again = crate::retry::Again::new();
    let mut look_again = LOOK_AGAIN_MIN;
    let mut announced = false;
    loop {
        let step = try_handle(shared, message, ticket, &mut permit).await;
        if !matches!(step, Ok(Step::Done | Step::Interrupted)) {
            permit = None;
        }
        match step {
            Ok(Step::Done) => return true,
            Ok(Step::Interrupted) => return false,
            Ok(Step::NoHandler(kind)) => {
                if !wait_for_handler(shared, message, &kind, &mut announced).await {
                    return false;
                }
            }
            Ok(Step::WaitUntil(until)) => {
                let wait = look_again_in(shared, until, &mut look_again);
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            Err(e) if jobfold_common::db::data_error_in(&e).is_some() => {
                // Postgres refuses what this event would write (a data error about its own
                // rows, found alone): the event's fault, so it is set aside, not retried for
                // ever with the partition behind it.
                let (code, refused) = jobfold_common::db::data_error_in(&e).expect("checked");
                let reason =
                    format!("the database refused what this event causes ({code}): {refused}");
                match set_aside(shared, message, &reason).await {
                    Ok(()) => return true,
                    Err(e) => {
                        tracing::warn!(error = %e, "Storing the dead letter failed; retrying.")
                    }
                }
                if !again.pause(&shared.shutdown).await {
                    return false;
                }
            }
            Err(e) => {
                let at = message.at(&shared.config.topics.events).coordinates();
                let error = MessageError { at, cause: e };
                MessageRetried { error: &error, stage: "dispatch", backoff: again.next() }.emit();
                if !again.pause(&shared.shutdown).await {
                    return false;
                }
            }
        }
    }
}

/// Waits a while for a processor with a handler for `kind` (counted in
/// `jobfold_waiting_for_handler`, announced once a message); false if stopped meanwhile.
pub(super) async fn wait_for_handler(
    shared: &Shared,
    message: &Held,
    kind: &str,
    announced: &mut bool,
) -> bool {
    use std::sync::atomic::Ordering;
    let waiting = shared.waiting_for_handler.fetch_add(1, Ordering::Relaxed) + 1;
    metrics::gauge!(pm::WAITING_FOR_HANDLER).set(waiting as f64);
    if !*announced {
        tracing::warn!(
            kind = %kind,
            partition = message.partition,
            offset = message.offset,
            "No handler for this kind here; the job waits for a processor that has one."
        );
        *announced = true;
    }
    let stopped = tokio::select! {
        _ = shared.shutdown.cancelled() => true,
        _ = tokio::time::sleep(NO_HANDLER_RETRY) => false,
    };
    let waiting = shared.waiting_for_handler.fetch_sub(1, Ordering::Relaxed) - 1;
    metrics::gauge!(pm::WAITING_FOR_HANDLER).set(waiting as f64);
    !stopped
}

/// How long to wait before looking again at a job another worker's live lease holds until
/// `until`. That lease ends at its completion, which may come long before `until` (a
/// stopping processor finishing the jobs of the partitions it handed over): looked at again
/// sooner at first (`look_again`, doubled each time), and never later than a lease's TTL.
pub(super) fn look_again_in(
    shared: &Shared,
    until: DateTime<Utc>,
    look_again: &mut Duration,
) -> Duration {
    let wait = ((until - Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(50))
        .min(*look_again);
    *look_again = (*look_again * 2).min(LOOK_AGAIN_MAX);
    let longest_ttl =
        shared.config.processor.lease_ttl.max(
            shared.config.kinds.values().filter_map(|k| k.lease_ttl).max().unwrap_or_default(),
        );
    wait.min(longest_ttl)
}

pub(super) enum Step {
    Done,
    WaitUntil(DateTime<Utc>),
    /// No handler here for this kind: look again later.
    NoHandler(String),
    /// Shutdown interrupted the attempt: leave the message for redelivery.
    Interrupted,
}

/// How often a job of a kind without a handler here is looked at again.
pub(super) const NO_HANDLER_RETRY: Duration = Duration::from_secs(5);

pub(super) async fn try_handle(
    shared: &Shared,
    message: &Held,
    ticket: &Ticket,
    permit: &mut Option<OwnedSemaphorePermit>,
) -> anyhow::Result<Step> {
    let Some(payload) = message.payload.as_deref() else {
        set_aside(shared, message, "message has no value").await?;
        return Ok(Step::Done);
    };
    // Boxed, as are the slot's wait and the attempt below: a document's task lives as long
    // as its queue, so it keeps only what all three have in common inline.
    let event = match Box::pin(shared.decoder.decode(payload)).await {
        Ok(event) => event,
        Err(e) if e.is_retryable() => return Err(e.into()),
        Err(e) => {
            let error = format!("undecodable: {e}");
            set_aside(shared, message, &error).await?;
            return Ok(Step::Done);
        }
    };
    if !event.payload.is_dispatch() {
        return Ok(Step::Done);
    }
    // A kind this processor has no handler for (a rolling deploy adding one): not this
    // job's fault, so it is neither leased nor quarantined; its document waits here, visibly,
    // until a processor that has the handler takes the partition.
    let Some(handler) = shared.handlers.get(&event.job_kind).cloned() else {
        return Ok(Step::NoHandler(event.job_kind));
    };
    // A paused kind's job is passed over, noted to be dispatched again on resume: it is not
    // leased, spends no attempt, and holds neither a slot nor its document's turn.
    if shared.pauses.holds(&event.job_kind)
        && Box::pin(crate::store::kinds::pass_over(&shared.pool, event.job_id, &event.job_kind))
            .await?
    {
        let label = shared.handlers.label(&event.job_kind);
        metrics::counter!(pm::PAUSED_PASSED_OVER_TOTAL, "kind" => label).increment(1);
        tracing::debug!(job_id = %event.job_id, kind = event.job_kind, "Passed over: its kind is paused.");
        return Ok(Step::Done);
    }
    // A slot (the kind's, then the process's) from here to the completion; a revoke or the
    // shutdown while waiting leaves the message for redelivery.
    let revoked = shared.tracker.lock().expect("tracker").revoked(ticket);
    // A redelivered dispatch the lease transaction is sure to skip takes no quota.
    let Seen::Open(input) = Box::pin(seen(shared, &event)).await? else {
        return Ok(Step::Done);
    };
    let (cost, handler) = if shared.quotas.costs(&event.job_kind) {
        match cost_of(&event.job_kind, handler.as_ref(), input.as_ref()) {
            Ok(cost) => (cost, handler),
            // The handler's `cost` panicked on this input: the job's failure, not the
            // document's or the partition's. It is leased and its attempt fails, naming the
            // panic, without running (its quota is not taken).
            Err(panic) => {
                (0, Arc::new(Fails(format!("the handler's cost panicked: {panic}"))) as _)
            }
        }
    } else {
        (1, handler)
    };
    let held = permit.take();
    let Some(_slot) =
        Box::pin(Slot::acquire(shared, &event.job_kind, cost, &revoked, held)).await?
    else {
        return Ok(Step::Interrupted);
    };
    // The attempt's state (lease, run, completion) is allocated once it runs: a document's
    // task waiting for a slot or behind another job stays small, so what the buffer holds
    // costs little memory each.
    Box::pin(attempt(shared, &event, handler)).await
}

/// After a panic handling `message`: it is stored as a dead letter naming the panic (true),
/// or, if that fails too, left for redelivery (false).
pub(super) async fn set_aside_panic(
    shared: &Shared,
    message: &Held,
    panic: Box<dyn std::any::Any + Send>,
) -> bool {
    let reason = format!("handling it panicked: {}", panic_message(panic.as_ref()));
    tracing::error!(partition = message.partition, offset = message.offset, %reason, "A message's handling panicked; it is set aside.");
    match set_aside(shared, message, &reason).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "Storing the dead letter failed; the message is left for redelivery.");
            false
        }
    }
}

/// Stores `message` in `dead_letters` with `reason`. Boxed: a rare path whose future would
/// otherwise be part of every document's task.
pub(super) async fn set_aside(shared: &Shared, message: &Held, reason: &str) -> anyhow::Result<()> {
    Ok(Box::pin(crate::dead_letter::store(
        &shared.pool,
        &shared.config.processor.group,
        message.raw(&shared.config.topics.events),
        reason,
    ))
    .await?)
}

/// What a dispatch of a kind whose admission takes quota meets in its job's row.
pub(super) enum Seen {
    /// The lease transaction is sure to skip it as a duplicate.
    Over,
    /// It goes on to its quota and the lease transaction; the job's input, if there is a job.
    Open(Option<serde_json::Value>),
}

/// Reads `event`'s job (no lock) and asks [`crate::lease::decide`] about it: a dispatch
/// older than the one that leased the job's newest attempt, or that one with its attempt
/// over, is a duplicate — a verdict later writes can only confirm (`dispatch_version` only
/// rises; an attempt over stays over, a replay dispatching anew). Only then is it
/// [`Seen::Over`]: a rebalance re-reading a partition's finished work (its offsets trail
/// its slowest document) would otherwise spend a provider's requests and cost on it, taken
/// from the work still to do.
///
/// A kind whose admission takes no quota is not looked at ([`Seen::Open`] with no input):
/// the lease transaction decides alone, as for any kind.
pub(super) async fn seen(shared: &Shared, event: &JobEvent) -> anyhow::Result<Seen> {
    if !shared.quotas.may_wait(&event.job_kind) {
        return Ok(Seen::Open(None));
    }
    let row = crate::store::select_job_rows!("FROM jobs WHERE job_id = $1", event.job_id)
        .fetch_optional(&shared.pool)
        .await?;
    let Some(job) = row else { return Ok(Seen::Open(None)) };
    let decision = crate::lease::decide(
        &job,
        event.input_version,
        event.stream_version,
        None,
        chrono::Utc::now(),
    );
    if decision != crate::lease::LeaseDecision::Duplicate {
        return Ok(Seen::Open(Some(job.payload)));
    }
    metrics::counter!(pm::DUPLICATES_SKIPPED_TOTAL).increment(1);
    tracing::debug!(event_id = %event.event_id, "Duplicate event skipped before its quota.");
    Ok(Seen::Over)
}

/// A job's cost against its kind's `cost_per_minute`, from its input (1 without one);
/// `Err` with the panic's message if the handler's `cost` panicked.
pub(super) fn cost_of(
    kind: &str,
    handler: &dyn crate::handler::ErasedHandler,
    input: Option<&serde_json::Value>,
) -> Result<u64, String> {
    let Some(input) = input else { return Ok(1) };
    let call = crate::panics::Call::new(kind, "cost");
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::panics::user(&call, || handler.cost_of(input))
    }))
    .map_err(|panic| panic_message(panic.as_ref()))
}

/// Stands in for a handler that cannot be run on this job: every attempt fails retryably
/// with the reason, so the job ends by its budget, quarantined with it.
pub(super) struct Fails(String);

impl crate::handler::Handler for Fails {
    async fn run(
        &self,
        _job: &JobContext,
        _cancel: CancellationToken,
    ) -> Result<serde_json::Value, HandlerError> {
        Err(HandlerError::retryable(self.0.clone()))
    }
}

/// Leases, runs and completes the dispatch `event` (its slot held by the caller).
///
/// A kind with an `inline_window` is offered to run before its lease commits: the lease
/// transaction sends the job here, waits for the attempt up to the window and commits the
/// two together; past the window it commits the lease alone and the attempt completes on
/// its own, as any other.
pub(super) async fn attempt(
    shared: &Shared,
    event: &JobEvent,
    handler: std::sync::Arc<dyn crate::handler::ErasedHandler>,
) -> anyhow::Result<Step> {
    // Each phase (lease, run, completion) is boxed: the attempt keeps inline only what they
    // share, and a run that lasts keeps only its own state, not the lease's or the
    // completion's (ten thousand long remote jobs in flight in one process).
    // 1. Lease (in a transaction with the other dispatches waiting at the time), run before
    //    it commits when the transaction sends the job to run.
    let Some((leased, ran)) = Box::pin(lease(shared, event, &handler)).await? else {
        return Ok(Step::Interrupted);
    };
    let job = match leased {
        Leased::Completed(done) => {
            let generation = ran.map_or(0, |a| a.job.generation);
            return Ok(completed(shared, event.job_id, generation, done));
        }
        Leased::Done => return Ok(Step::Done),
        Leased::WaitUntil(until) => return Ok(Step::WaitUntil(until)),
        Leased::Run(job) => Some((job, false)),
        Leased::Isolated(job) => Some((job, true)),
        Leased::RunOn => None,
    };
    // 2. The lease committed alone. An attempt already run under it completes; otherwise
    //    (no run yet, or one under another generation) the handler runs now.
    let attempt = match (ran, job) {
        (Some(attempt), None) => attempt,
        (Some(attempt), Some((job, _))) if attempt.job.generation == job.generation => attempt,
        (_, None) => anyhow::bail!("a lease committed for a run this task did not make"),
        (_, Some((job, isolated))) => {
            failpoint::hit(failpoint::Point::ProcessorAfterLeaseCommit);
            let ran = if isolated {
                match Box::pin(run_isolated(shared, event, &handler, job)).await? {
                    Ok(ran) => ran,
                    // Lost while it waited its turn (an operator cancelled the job): as a
                    // fenced completion, nothing of this event is left to do.
                    Err(LeaseLost) => return Ok(Step::Done),
                }
            } else {
                Box::pin(run_handler(shared, event, &handler, job)).await?
            };
            match ran {
                Some(attempt) => Arc::new(attempt),
                None => return Ok(Step::Interrupted),
            }
        }
    };
    // 3. Complete, fenced by the generation.
    Box::pin(complete(shared, attempt)).await
}

/// An attempt's lease, in a transaction with the other dispatches waiting at the time. A
/// kind with an `inline_window` may be sent to run before the lease commits: then the
/// attempt run is returned too; `None` if the processor's stop cut that run short.
pub(super) async fn lease(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
) -> anyhow::Result<Option<(Leased, Option<Arc<Attempt>>)>> {
    let dispatch = Dispatch {
        job_id: event.job_id,
        event_id: event.event_id,
        input_version: event.input_version,
        stream_version: event.stream_version,
        trace: event.trace.clone(),
    };
    let window = shared.config.kind(&event.job_kind).inline_window;
    let (inline, mut offered) = if window.is_zero() {
        (None, None)
    } else {
        let (run, offered) = tokio::sync::oneshot::channel();
        (Some(Inline { window, run }), Some(offered))
    };
    // Boxed: raced against the offer of an inline run, then, after that run, awaited again.
    let mut leased = Box::pin(shared.leaser.submit(Request { dispatch, inline }));
    let offer = async {
        match offered.as_mut() {
            Some(offered) => offered.await.ok(),
            None => None,
        }
    };
    let first = tokio::select! {
        biased;
        Some(run) = offer => Ok(run),
        leased = &mut leased => Err(leased),
    };
    let InlineRun { job, finished } = match first {
        Err(leased) => return Ok(Some((leased?, None))),
        Ok(run) => run,
    };
    // Run before the lease commits; the lease transaction waits for the attempt.
    let mut run = Box::pin(run_handler(shared, event, handler, Box::new(job)));
    // Once the lease transaction stops waiting (its window closed and the lease committed
    // alone), the way back is let go of: a long run keeps only what any run keeps.
    let mut finished = Some(finished);
    let ran = loop {
        let Some(back) = finished.as_mut() else { break run.await? };
        let closed = tokio::select! {
            ran = &mut run => break ran?,
            () = back.closed() => true,
        };
        if closed {
            finished = None;
        }
    };
    let Some(attempt) = ran else { return Ok(None) };
    // Kept: should the lease transaction fail, the lease is taken again alone and this
    // attempt completes after it.
    let attempt = Arc::new(attempt);
    if let Some(back) = finished {
        let _ = back.send(Arc::clone(&attempt));
    }
    Ok(Some((leased.await?, Some(attempt))))
}

/// Completes `attempt`, fenced by its generation, in a transaction with the other attempts
/// finished at the time. A completion that fails (the database unreachable) is tried again
/// with the same generation: the handler does not run again for it.
pub(super) async fn complete(shared: &Shared, attempt: Arc<Attempt>) -> anyhow::Result<Step> {
    let job_id = attempt.job.job_id;
    let generation = attempt.job.generation;
    let mut again = crate::retry::Again::new();
    let done = loop {
        match Box::pin(shared.completer.submit(Arc::clone(&attempt))).await {
            Ok(done) => break done,
            // About this attempt's own rows: its event is set aside by the caller.
            Err(e) if jobfold_common::db::data_error_in(&e).is_some() => return Err(e),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), %job_id, generation, "Completion failed; trying it again.");
                if !again.pause(&shared.hard).await {
                    return Ok(Step::Interrupted);
                }
            }
        }
    };
    Ok(completed(shared, job_id, generation, done))
}

/// A suspect's lease was lost while it waited for its isolated run: it did not run.
pub(super) struct LeaseLost;

/// Runs a suspect `job` (it was running when a process died), its lease committed: one such
/// run at a time in this process, recorded as started in a commit of its own and the record
/// deleted once the run returns. Should this run kill the process too, the record it leaves
/// names this job alone, whatever else ran beside it ([`crate::store::crashed_runs`]).
///
/// While it waits for its turn its lease is kept alive by heartbeats: suspects queued behind
/// a slow one would otherwise see their leases lapse, be leased again by the reaper's
/// dispatch (an attempt spent each) and later take the one turn only to be fenced.
pub(super) async fn run_isolated(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    job: Box<JobRow>,
) -> anyhow::Result<Result<Option<Attempt>, LeaseLost>> {
    let kind = shared.config.kind(&job.kind);
    let lost = shared.hard.child_token();
    let waiting = shared.heartbeats.register(
        job.job_id,
        job.generation,
        kind.heartbeat,
        kind.lease_ttl,
        lost.clone(),
    );
    let _alone = tokio::select! {
        _ = lost.cancelled() => {
            if shared.hard.is_cancelled() {
                // Stopped before its turn came: given back, as a run cut short is.
                let mut job = *job;
                let context = context_of(&mut job, None);
                return Ok(Ok(Some(released(&shared.owner, job, context, event.trace.clone()))));
            }
            tracing::info!(job_id = %job.job_id, generation = job.generation, "A suspect's lease was lost while it waited for its isolated run.");
            return Ok(Err(LeaseLost));
        }
        permit = shared.suspects.acquire() => permit?,
    };
    // The run registers the lease again, taking it over with its renewal times as they are;
    // the run's registration ends it, this one's drop after that finds nothing left.
    let _waiting = waiting;
    let (run_id, job_id) = (uuid::Uuid::new_v4(), job.job_id);
    tracing::info!(%job_id, generation = job.generation, "A suspect runs isolated: should its process die now, the death is charged to it alone.");
    crate::store::inline_runs_begin(&shared.pool, run_id, &[job_id], &shared.owner).await?;
    let ran = run_handler(shared, event, handler, job).await;
    // The run returned (whatever it made of the job): it did not take the process down, so
    // its crashes so far are not counted against it any more.
    let mut again = crate::retry::Again::new();
    while let Err(e) = crate::store::isolated_run_survived(&shared.pool, run_id, job_id).await {
        tracing::warn!(error = %e, "Deleting an isolated run's record failed; trying again.");
        if !again.pause(&shared.shutdown).await {
            break;
        }
    }
    ran.map(Ok)
}

/// Counts what became of an attempt; its offset may be stored.
pub(super) fn completed(
    shared: &Shared,
    job_id: uuid::Uuid,
    generation: i64,
    done: Completed,
) -> Step {
    match done {
        Completed::Fenced => {
            CompletionFenced { job_id, generation }.emit();
            return Step::Done;
        }
        Completed::Committed { job, outcome } => {
            crate::complete::count(&job, outcome, &shared.handlers);
            tracing::debug!(job_id = %job.job_id, outcome, "Attempt completed.");
        }
    }
    failpoint::hit(failpoint::Point::ProcessorAfterCompletionBeforeOffset);
    Step::Done
}

/// Runs the handler on `job`, leased (its lease committed, or held by a lease transaction
/// waiting for this run), with heartbeats: the finished attempt, or `None` when the shutdown
/// cut it short (not the job's fault: no attempt is spent).
pub(super) async fn run_handler(
    shared: &Shared,
    event: &JobEvent,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    mut job: Box<JobRow>,
) -> anyhow::Result<Option<Attempt>> {
    let (span, context) = job_span(event, &mut job);
    // Run, with heartbeats. The handler's token fires when the lease is lost or at the
    // processor's hard stop; the heartbeat stops with the run, whatever the handler does
    // (returns, panics), as the lease's registration drops.
    let kind = RunLimits::of(&shared.config, &job.kind);
    let _listed = shared.running.enter(job.job_id, job.generation, &job.kind, &job.document_id);
    let cancel = shared.hard.child_token();
    let lease = shared.heartbeats.register(
        job.job_id,
        job.generation,
        kind.heartbeat,
        kind.lease_ttl,
        cancel.clone(),
    );
    let started = std::time::Instant::now();
    if job.attempt == 1 {
        let due = job.run_at.map_or(job.accepted_at, |at| at.max(job.accepted_at));
        crate::history::started(&job.kind, (Utc::now() - due).to_std().unwrap_or_default());
    }
    let result =
        run_contained(shared, handler, &context, &kind, &cancel).instrument(span.clone()).await;
    metrics::histogram!(pm::HANDLER_DURATION_SECONDS, "kind" => shared.handlers.label(&job.kind))
        .record(started.elapsed().as_secs_f64());
    crate::history::ran(&job.kind, started.elapsed());
    metrics::counter!(pm::HANDLER_RUNS_TOTAL).increment(1);
    failpoint::hit(failpoint::Point::ProcessorInHandler);
    drop(lease);
    // Fit to commit, and no wait an outside answer asks for past the kind's max_retry_after.
    let result = bounded(result, kind.max_output_bytes).map_err(|mut e| {
        e.retry_after = e.retry_after.map(|d| d.min(kind.max_retry_after));
        e
    });
    if let Err(e) = &result
        && e.throttled
    {
        // The kind backs off at once, here and in the group's other processors.
        let label = shared.handlers.label(&job.kind);
        Box::pin(shared.quotas.throttled(&job.kind, &label, e.retry_after)).await;
    }
    if result.is_err() && shared.hard.is_cancelled() {
        // Cut short by the stop, not the job's fault: its lease is given back with its
        // attempt, and the job is due again at once for whichever processor takes it.
        tracing::info!(job_id = %job.job_id, "The stop cancelled the handler; the job is given back.");
        return Ok(Some(released(&shared.owner, *job, context, event.trace.clone())));
    }

    Ok(Some(Attempt { job: *job, context, result, trace: event.trace.clone(), released: false }))
}

/// The handler's span, continuing the job's W3C trace (its own span id, the accepting
/// request's span as parent), and the job's context for the handler, whose `trace` the
/// handler sends onward. The span is made once its fields are known: a log layer formats
/// them when it is made and on every record.
pub(super) fn job_span(event: &JobEvent, job: &mut JobRow) -> (tracing::Span, JobContext) {
    let span_id = event.trace.as_ref().map(|_| format!("{:016x}", rand::rng().random::<u64>() | 1));
    let ids = event.trace.as_ref().and_then(|trace| trace.ids());
    let span = tracing::info_span!(
        "job",
        job_id = %event.job_id,
        document_id = %event.document_id,
        event = event.payload.kind(),
        attempt = job.attempt,
        generation = job.generation,
        trace_id = ids.map(|(trace_id, _)| trace_id),
        span_id = ids.and(span_id.as_deref()),
        parent_span_id = ids.map(|(_, parent_id)| parent_id),
    );
    let handler_trace =
        event.trace.as_ref().zip(span_id.as_deref()).and_then(|(trace, id)| trace.child(id));
    (span, context_of(job, handler_trace))
}

/// Runs `handler` on `context`, contained: a panic, a run past the kind's `run_timeout` and
/// the processor's hard stop each end the run as a retryable failure that says so.
pub(super) async fn run_contained(
    shared: &Shared,
    handler: &std::sync::Arc<dyn crate::handler::ErasedHandler>,
    context: &JobContext,
    kind: &RunLimits,
    cancel: &CancellationToken,
) -> Result<serde_json::Value, HandlerError> {
    let run = crate::callback::SCOPE.scope(
        Arc::clone(&shared.callbacks),
        std::panic::AssertUnwindSafe(crate::panics::User::new(
            crate::panics::Call::new(&context.kind, "run"),
            handler.run_boxed(context, cancel.clone()),
        ))
        .catch_unwind(),
    );
    // Past the kind's run time-out the token fires and the run is dropped: a handler that
    // hangs, or ignores its token, costs its own attempt, not a slot for ever. Without one,
    // the time-out is too far to come.
    let timed = tokio::time::timeout(kind.run_timeout.unwrap_or(Duration::MAX), run);
    // At the hard stop the token fires; a handler deaf to it is dropped after a grace.
    let stopped = async {
        shared.hard.cancelled().await;
        tokio::time::sleep(RELEASE_GRACE).await;
    };
    let ran = tokio::select! {
        ran = timed => Some(ran.ok()),
        () = stopped => None,
    };
    match ran {
        None => Err(HandlerError::retryable("cut short by its processor's stop").ambiguous()),
        Some(Some(Ok(result))) => result,
        // A panic costs its own attempt: a retryable failure naming it. What it did before
        // is not known.
        Some(Some(Err(panic))) => Err(HandlerError::retryable(format!(
            "the handler panicked: {}",
            panic_message(panic.as_ref())
        ))
        .ambiguous()),
        Some(None) => {
            cancel.cancel();
            Err(HandlerError::retryable(format!(
                "the handler ran past its run_timeout ({:?}) and was cancelled",
                kind.run_timeout.unwrap_or_default()
            ))
            .ambiguous())
        }
    }
}

/// What a run needs of its kind's settings: kept while it runs instead of all of them.
pub(super) struct RunLimits {
    pub(super) heartbeat: Duration,
    pub(super) lease_ttl: Duration,
    pub(super) run_timeout: Option<Duration>,
    pub(super) max_output_bytes: usize,
    pub(super) max_retry_after: Duration,
}

impl RunLimits {
    pub(super) fn of(config: &Config, kind: &str) -> Self {
        let k = config.kind(kind);
        Self {
            heartbeat: k.heartbeat,
            lease_ttl: k.lease_ttl,
            run_timeout: k.run_timeout,
            max_output_bytes: k.max_output_bytes,
            max_retry_after: k.max_retry_after,
        }
    }
}

/// What a handler is told of `job`, leased. The job row's copy of the input is not needed
/// again: the context's is the only one.
pub(super) fn context_of(
    job: &mut JobRow,
    trace: Option<jobfold_schemas::event::TraceContext>,
) -> JobContext {
    JobContext {
        trace,
        job_id: job.job_id,
        document_id: job.document_id.clone(),
        kind: job.kind.clone(),
        input_version: job.input_version,
        input: std::mem::take(&mut job.payload),
        attempt: job.attempt,
        generation: job.generation,
        deadline: job.deadline,
        max_attempts: job.max_attempts,
        previous_outcome: PreviousOutcome::from_column(job.previous_outcome.as_deref()),
    }
}

/// The attempt of a run the processor's stop cut short: given back ([`Attempt::released`]),
/// naming the process.
pub(super) fn released(
    owner: &str,
    job: JobRow,
    context: JobContext,
    trace: Option<jobfold_schemas::event::TraceContext>,
) -> Attempt {
    let message = format!("released: its processor ({owner}) stopped before the run ended");
    Attempt { job, context, result: Err(HandlerError::retryable(message)), trace, released: true }
}

/// What a handler returned, made fit to commit and publish: a result larger than
/// `max_output_bytes` (its `JobSucceeded` event would be too large for the topic) or holding
/// U+0000 (Postgres cannot store it) becomes a permanent failure naming why; an error's text
/// is cut to [`MAX_ERROR_BYTES`] and cleared of U+0000. So whatever a handler returns costs
/// only its own job.
pub(super) fn bounded(
    result: Result<serde_json::Value, HandlerError>,
    max_output_bytes: usize,
) -> Result<serde_json::Value, HandlerError> {
    match result {
        Ok(output) => {
            let size = serde_json::to_vec(&output).map_or(usize::MAX, |v| v.len());
            if size > max_output_bytes {
                return Err(HandlerError::permanent(format!(
                    "the result is {size} bytes, more than its max_output_bytes \
                     ({max_output_bytes}: processor.max_output_bytes, or the kind's own)"
                )));
            }
            if let Some(path) = jobfold_common::accept::find_nul(&output) {
                return Err(HandlerError::permanent(format!(
                    "the result's `{}` contains U+0000 (NUL), which Postgres cannot store",
                    if path.is_empty() { "." } else { &path }
                )));
            }
            Ok(output)
        }
        Err(mut e) => {
            if e.message.contains('\0') {
                e.message = e.message.replace('\0', "\u{fffd}");
            }
            if e.message.len() > MAX_ERROR_BYTES {
                let mut cut = MAX_ERROR_BYTES - 3;
                while !e.message.is_char_boundary(cut) {
                    cut -= 1;
                }
                e.message.truncate(cut);
                e.message.push_str("...");
            }
            Err(e)
        }
    }
}
