//! The handler API ([`jobfold_handler`], re-exported here): what users implement to run a
//! kind of job, and the registry by kind. A handler crate depends on `jobfold-handler`
//! alone; the processor runs what it registers ([`crate::Processor::handler`]).

pub use jobfold_handler::*;

/// Records in `job_kinds` that a processor runs `handlers`' kinds, so accept takes jobs of
/// them (it refuses unregistered kinds unless `accept.any_kind`). In key order, so two
/// processors starting at once wait on each other in one direction only.
///
/// # Errors
/// The write failed.
pub async fn register(
    handlers: &Handlers,
    pool: &sqlx::PgPool,
    by: &str,
) -> Result<(), sqlx::Error> {
    let kinds: Vec<&str> = handlers.kinds().collect();
    if kinds.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "INSERT INTO job_kinds (kind, registered_by) SELECT unnest($1::text[]), $2 \
         ON CONFLICT (kind) DO UPDATE \
         SET last_registered = now(), registered_by = EXCLUDED.registered_by",
        &kinds as &[&str],
        by,
    )
    .execute(pool)
    .await?;
    Ok(())
}
