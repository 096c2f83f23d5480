//! The audit trail (`audit_log`, migration 0019): every change an operator made through the
//! HTTP API or the CLI — who, with which role, what, on what, when, and the request's id.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Longest `actor`, `action`, `target` or `request_id` kept (they may come from outside).
const FIELD_MAX: usize = 200;

/// How a change was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The HTTP API (and the console, which acts only through it).
    Api,
    /// The CLI's direct database path.
    Cli,
}

/// Who made a change: the API token's name and role (or `anonymous` on an API without
/// tokens), or the CLI's operating-system user; and the request's id.
#[derive(Debug, Clone)]
pub struct Actor {
    pub name: String,
    pub role: Option<String>,
    pub via: Via,
    pub request_id: Option<String>,
}

impl Actor {
    /// The operating-system user running this process (the CLI's direct database path).
    pub fn os_user() -> Self {
        let name = std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .ok()
            .filter(|u| !u.trim().is_empty())
            .map_or_else(|| format!("uid {}", uid()), |u| format!("os:{u}"));
        Self { name, role: None, via: Via::Cli, request_id: None }
    }
}

/// This process's user id, from `/proc` (Linux); `?` where that cannot be read.
fn uid() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|rest| rest.split_whitespace().next().map(str::to_owned))
        })
        .unwrap_or_else(|| "?".into())
}

fn cut(s: &str) -> String {
    s.chars().filter(|c| *c != '\0').take(FIELD_MAX).collect()
}

/// Records that `actor` did `action` on `target` (a job id, a kind, a dead letter; none for
/// a bulk change, whose filter and counts are in `detail`).
///
/// # Errors
/// The database failed.
pub async fn record<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    actor: &Actor,
    action: &str,
    target: Option<&str>,
    detail: Value,
) -> Result<(), sqlx::Error> {
    let via = match actor.via {
        Via::Api => "api",
        Via::Cli => "cli",
    };
    sqlx::query!(
        "INSERT INTO audit_log (actor, role, via, action, target, request_id, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        cut(&actor.name),
        actor.role.as_deref().map(cut),
        via,
        cut(action),
        target.map(cut),
        actor.request_id.as_deref().map(cut),
        detail,
    )
    .execute(executor)
    .await?;
    Ok(())
}

/// One change, as `GET /v1/audit` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub id: i64,
    pub at: chrono::DateTime<chrono::Utc>,
    pub actor: String,
    pub role: Option<String>,
    pub via: String,
    pub action: String,
    pub target: Option<String>,
    pub request_id: Option<String>,
    pub detail: Value,
}

/// `GET /v1/audit`'s filter: newest first, before `before` (an id), at most `limit`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditFilter {
    #[serde(default)]
    pub actor: Option<String>,
    #[serde(default)]
    pub action: Option<String>,
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default)]
    pub before: Option<i64>,
    #[serde(default)]
    pub limit: Option<i64>,
}

/// A page of the trail, newest first; `next` is the `before` of the next page.
#[derive(Debug, Clone, Serialize)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    pub next: Option<i64>,
}

/// The changes `filter` selects, newest first.
///
/// # Errors
/// The database failed.
pub async fn list(pool: &sqlx::PgPool, filter: &AuditFilter) -> Result<AuditPage, sqlx::Error> {
    let limit = filter.limit.unwrap_or(100).clamp(1, 1000);
    let entries = sqlx::query_as!(
        AuditEntry,
        "SELECT id, at, actor, role, via, action, target, request_id, detail FROM audit_log \
         WHERE ($1::text IS NULL OR actor = $1) AND ($2::text IS NULL OR action = $2) \
           AND ($3::text IS NULL OR target = $3) AND ($4::bigint IS NULL OR id < $4) \
         ORDER BY id DESC LIMIT $5",
        filter.actor,
        filter.action,
        filter.target,
        filter.before,
        limit,
    )
    .fetch_all(pool)
    .await?;
    let next = (entries.len() as i64 == limit).then(|| entries.last().map(|e| e.id)).flatten();
    Ok(AuditPage { entries, next })
}
