//! Pausing a kind for the whole group, and resuming it (`kind_pauses`, migration 0017).
//!
//! A processor that finds a dispatch of a paused kind passes over it ([`pass_over`]): the
//! job is not leased, spends no attempt and holds no slot; it stays queued (or waiting to
//! retry, or holding a lease that expired: the reaper's dispatch for a dead worker's job is
//! passed over too) and is noted in `paused_dispatches`. [`resume`] deletes the pause and
//! dispatches the noted jobs again (a `RetryDue`, as the reaper does for a stalled job), in
//! batches; the reaper dispatches whatever a resume cut short left
//! ([`dispatch_passed_over`]).
//! Every pause and resume is in `kind_pause_log`: who, when, why.

use super::*;

/// Longest `requested_by` kept.
pub const BY_MAX: usize = 200;
/// Longest `reason` kept.
pub const REASON_MAX: usize = 2000;
/// Jobs dispatched again per transaction by a resume or a reaper round.
const REDISPATCH_BATCH: i64 = 500;

/// Why a pause or resume was refused.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    #[error("no kind {kind:?}: known kinds are {known:?}")]
    Unknown { kind: String, known: Vec<String> },
    #[error("{field} is longer than {max} characters")]
    TooLong { field: &'static str, max: usize },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A pause or resume request.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct KindControl {
    /// Who asks (operator name, API client).
    #[serde(default)]
    pub requested_by: Option<String>,
    /// Why (a provider's outage, a broken handler).
    #[serde(default)]
    pub reason: Option<String>,
}

impl KindError {
    /// `kind` is echoed cut to [`BY_MAX`] characters: it came from outside.
    fn unknown(kind: &str, known: Vec<String>) -> Self {
        Self::Unknown { kind: kind.chars().take(BY_MAX).collect(), known }
    }
}

impl KindControl {
    /// Who and why, bounded and without NUL (which Postgres's text refuses).
    fn checked(self) -> Result<(String, Option<String>), KindError> {
        let clean = |s: String| s.replace('\0', "\u{fffd}");
        let by = self.requested_by.map_or_else(|| "unknown".to_owned(), clean);
        if by.chars().count() > BY_MAX {
            return Err(KindError::TooLong { field: "requested_by", max: BY_MAX });
        }
        let reason = self.reason.map(clean);
        if reason.as_ref().is_some_and(|r| r.chars().count() > REASON_MAX) {
            return Err(KindError::TooLong { field: "reason", max: REASON_MAX });
        }
        Ok((by, reason))
    }
}

/// A kind as `GET /v1/kinds` and `jobfold kinds list` show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KindState {
    pub kind: String,
    pub paused: bool,
    pub paused_at: Option<DateTime<Utc>>,
    pub paused_by: Option<String>,
    pub reason: Option<String>,
    /// Jobs whose dispatch was passed over while paused, to be dispatched on resume.
    pub waiting: i64,
    /// When a processor last registered a handler for it; `None` for a kind paused before
    /// any processor ran it.
    pub last_registered: Option<DateTime<Utc>>,
}

/// What a pause or resume did.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KindChanged {
    pub kind: String,
    pub paused: bool,
    /// Whether it was paused before the request (a pause or resume repeated changes nothing
    /// and logs nothing).
    pub was_paused: bool,
    /// Jobs dispatched again by a resume.
    pub dispatched: u64,
}

/// Every kind a processor registered or an operator paused, with its pause.
///
/// # Errors
/// The database failed.
pub async fn kinds(pool: &sqlx::PgPool) -> Result<Vec<KindState>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"
        SELECT coalesce(k.kind, p.kind) AS "kind!", p.kind IS NOT NULL AS "paused!",
               p.paused_at AS "paused_at?", p.paused_by AS "paused_by?", p.reason AS "reason?",
               (SELECT count(*) FROM paused_dispatches d WHERE d.kind = coalesce(k.kind, p.kind))
                   AS "waiting!",
               k.last_registered AS "last_registered?"
        FROM job_kinds k FULL JOIN kind_pauses p ON p.kind = k.kind
        ORDER BY 1
        "#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| KindState {
            kind: r.kind,
            paused: r.paused,
            paused_at: r.paused_at,
            paused_by: r.paused_by,
            reason: r.reason,
            waiting: r.waiting,
            last_registered: r.last_registered,
        })
        .collect())
}

/// Pauses `kind` for the whole group: processors pass over its dispatches from their next
/// look at the pauses (within [`crate::pauses::POLL`]); its running jobs finish. A kind no
/// processor ever registered is refused (a misspelt name would pause nothing).
///
/// # Errors
/// [`KindError`]; nothing was written.
pub async fn pause(
    pool: &sqlx::PgPool,
    kind: &str,
    request: KindControl,
) -> Result<KindChanged, KindError> {
    let (by, reason) = request.checked()?;
    let mut tx = pool.begin().await?;
    let known =
        sqlx::query_scalar!("SELECT kind FROM job_kinds ORDER BY kind").fetch_all(&mut *tx).await?;
    if !known.iter().any(|k| k == kind) {
        return Err(KindError::unknown(kind, known));
    }
    let paused = sqlx::query!(
        "INSERT INTO kind_pauses (kind, paused_by, reason) VALUES ($1, $2, $3) \
         ON CONFLICT (kind) DO NOTHING RETURNING kind",
        kind,
        by,
        reason,
    )
    .fetch_optional(&mut *tx)
    .await?
    .is_some();
    if paused {
        log(&mut tx, kind, "pause", &by, reason.as_deref()).await?;
    }
    tx.commit().await?;
    if paused {
        tracing::info!(kind, by, reason, "Kind paused.");
    }
    Ok(KindChanged { kind: kind.to_owned(), paused: true, was_paused: !paused, dispatched: 0 })
}

/// Resumes `kind`: deletes its pause, then dispatches again every job passed over while it
/// was paused, [`REDISPATCH_BATCH`] to a transaction. Resuming a kind that is not paused
/// still dispatches what waits (a resume cut short before).
///
/// # Errors
/// [`KindError`]; a committed resume stays, and the reaper dispatches what is left.
pub async fn resume(
    pool: &sqlx::PgPool,
    events: &Events,
    kind: &str,
    request: KindControl,
) -> Result<KindChanged, KindError> {
    let (by, reason) = request.checked()?;
    let mut tx = pool.begin().await?;
    let resumed = sqlx::query!("DELETE FROM kind_pauses WHERE kind = $1 RETURNING kind", kind)
        .fetch_optional(&mut *tx)
        .await?
        .is_some();
    if resumed {
        log(&mut tx, kind, "resume", &by, reason.as_deref()).await?;
    } else if !sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM job_kinds WHERE kind = $1) AS "known!""#,
        kind
    )
    .fetch_one(&mut *tx)
    .await?
    {
        let known = sqlx::query_scalar!("SELECT kind FROM job_kinds ORDER BY kind")
            .fetch_all(&mut *tx)
            .await?;
        return Err(KindError::unknown(kind, known));
    }
    tx.commit().await?;
    if resumed {
        tracing::info!(kind, by, reason, "Kind resumed.");
    }
    let mut dispatched = 0;
    loop {
        let batch = dispatch_passed_over(pool, events, Some(kind)).await?;
        if batch.taken == 0 {
            break;
        }
        dispatched += batch.dispatched;
    }
    Ok(KindChanged { kind: kind.to_owned(), paused: false, was_paused: resumed, dispatched })
}

async fn log(
    tx: &mut PgConnection,
    kind: &str,
    action: &str,
    by: &str,
    reason: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO kind_pause_log (kind, action, by_whom, reason) VALUES ($1, $2, $3, $4)",
        kind,
        action,
        by,
        reason,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// Called by a processor for a dispatch of `job_id` of a kind it believes paused: notes the
/// job as passed over and returns true if the kind is paused now; false (nothing written)
/// if it was resumed meanwhile, and the dispatch is to run. The pause row is share-locked
/// while the note is written, so a concurrent resume dispatches the job again after it.
///
/// # Errors
/// The database failed.
pub async fn pass_over(pool: &sqlx::PgPool, job_id: Uuid, kind: &str) -> Result<bool, sqlx::Error> {
    let noted = sqlx::query_scalar!(
        "INSERT INTO paused_dispatches (job_id, kind) \
         SELECT $1, kind FROM kind_pauses WHERE kind = $2 FOR SHARE \
         ON CONFLICT (job_id) DO UPDATE SET passed_at = excluded.passed_at \
         RETURNING job_id",
        job_id,
        kind,
    )
    .fetch_optional(pool)
    .await?;
    Ok(noted.is_some())
}

/// What one batch of [`dispatch_passed_over`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redispatched {
    /// Notes taken (and deleted); 0: none was left.
    pub taken: u64,
    /// Of their jobs, those dispatched again (the others had ended, or run under a live lease).
    pub dispatched: u64,
}

/// Dispatches again up to [`REDISPATCH_BATCH`] jobs passed over while their kind (`kind`,
/// or any) was paused and that no longer is, in one transaction: each still open and not
/// running under a live lease gets a `RetryDue` due now; every note taken is deleted.
///
/// # Errors
/// The database failed, or an event did not encode; nothing of this batch was written.
pub async fn dispatch_passed_over(
    pool: &sqlx::PgPool,
    events: &Events,
    kind: Option<&str>,
) -> anyhow::Result<Redispatched> {
    let mut tx = pool.begin().await?;
    let ids = sqlx::query_scalar!(
        "SELECT d.job_id FROM paused_dispatches d \
         WHERE ($1::text IS NULL OR d.kind = $1) \
           AND NOT EXISTS (SELECT 1 FROM kind_pauses p WHERE p.kind = d.kind) \
         ORDER BY d.kind, d.job_id LIMIT $2 FOR UPDATE OF d SKIP LOCKED",
        kind,
        REDISPATCH_BATCH,
    )
    .fetch_all(&mut *tx)
    .await?;
    if ids.is_empty() {
        return Ok(Redispatched { taken: 0, dispatched: 0 });
    }
    let mut jobs = lock_jobs(&mut tx, &ids).await?;
    let later = retries_not_due(&mut tx, &ids).await?;
    let mut alone = Vec::new();
    let mut dispatched = 0u64;
    for job in &mut jobs {
        if !due_again(job, Utc::now()) || later.contains(&job.job_id) {
            continue;
        }
        if !job.fresh_xid {
            alone.push(job.job_id);
            continue;
        }
        redispatch(&mut tx, events, job).await?;
        dispatched += 1;
    }
    sqlx::query!(
        "DELETE FROM paused_dispatches WHERE job_id = ANY($1) AND NOT job_id = ANY($2)",
        &ids,
        &alone,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    // A job written meanwhile by a later transaction cannot be appended to in that one (see
    // JobRow::fresh_xid): each gets a transaction of its own.
    for job_id in alone {
        let mut tx = pool.begin().await?;
        if let Some(mut job) = lock_job(&mut tx, job_id).await?
            && due_again(&job, Utc::now())
            && retries_not_due(&mut tx, &[job_id]).await?.is_empty()
        {
            redispatch(&mut tx, events, &mut job).await?;
            dispatched += 1;
        }
        sqlx::query!("DELETE FROM paused_dispatches WHERE job_id = $1", job_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    if dispatched > 0 {
        metrics::counter!(crate::metrics::RESUMED_DISPATCHES_TOTAL).increment(dispatched);
    }
    Ok(Redispatched { taken: ids.len() as u64, dispatched })
}

/// Whether a passed-over job still needs a dispatch: open, and not under a live lease (a
/// dispatch that got through before the pause runs it). A lease that expired is no one's:
/// the dispatch passed over was the reaper's for it, which looks at the job again only
/// `processor.stall_after` later.
fn due_again(job: &JobRow, now: DateTime<Utc>) -> bool {
    match job.state {
        Status::Queued | Status::RetryWait => true,
        Status::Leased => job.lease_until.is_none_or(|until| until <= now),
        _ => false,
    }
}

/// Of `job_ids` (locked), those waiting for a retry not yet due: the dispatch passed over was
/// an earlier one (a stalled job's), and the retry's own `RetryDue` is still to come.
async fn retries_not_due(
    tx: &mut PgConnection,
    job_ids: &[Uuid],
) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT job_id FROM jobs WHERE job_id = ANY($1) AND state = 'retry_wait' \
         AND next_attempt_at > now()",
        job_ids,
    )
    .fetch_all(tx)
    .await
}

async fn redispatch(
    tx: &mut PgConnection,
    events: &Events,
    job: &mut JobRow,
) -> anyhow::Result<()> {
    use jobfold_schemas::event::DispatchReason;
    // As the reaper names it: a job whose lease expired, or one that waited.
    let reason = if job.state == Status::Leased {
        DispatchReason::LeaseExpired
    } else {
        DispatchReason::Stalled
    };
    let due = Payload::RetryDue(jobfold_schemas::event::RetryDue { due_at: Utc::now(), reason });
    events.append(tx, job, due, None, None).await
}
