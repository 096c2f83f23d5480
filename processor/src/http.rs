//! The processor's HTTP API.
//!
//! - `POST /v1/jobs` accepts a job. An `Idempotency-Key` header (or `idempotency_key` in
//!   the body) makes retries safe: the first accept answers 201, a retry of the same request
//!   200 with the same job id, the same key with a different request 409. A body over
//!   `accept.max_input_bytes` is refused with 413, an invalid one with 422 naming the field.
//!   Requests arriving together share one transaction (group commit); each is answered once
//!   its job is durable, and each fails only for itself.
//! - `POST /v1/jobs/batch` (`{"jobs": [...]}`, 1 to 1,000 jobs of the same shape, each with
//!   its own `idempotency_key`, a body up to `accept.max_batch_bytes`): one transaction;
//!   200 with each job's answer in order (`status` 201, 200, or its error's status and
//!   `error`): one bad job fails only itself.
//! - `GET /v1/jobs/{id}`: the job as the `jobs` projection holds it (with its quarantine
//!   reason and owner while quarantined).
//! - `GET /v1/jobs/{id}/events`: its event history, decoded, in stream order.
//! - `GET /v1/quarantine?owner=&kind=&reason=&limit=`: quarantined jobs, newest first;
//!   `GET /v1/quarantine/groups` (the same filter): grouped by owner, kind, error class and
//!   reason, with their counts, largest first.
//! - `POST /v1/jobs/{id}/replay`: runs a quarantined job again with a fresh budget, optionally
//!   with `{"new_input_version": n, "new_input": {...}}`; 202, or 409 if it is not quarantined.
//! - `GET /v1/jobs?state=&kind=&document_id=&since=&limit=&after=&order=`: jobs in job id
//!   (acceptance) order, keyset-paged: `{"jobs": [...], "next": id}`; pass `next` as `after`.
//! - `POST /v1/jobs/{id}/cancel` (`{"reason": "...", "requested_by": "..."}`, optional): an
//!   open job ends `cancelled` (a running one's handler is cancelled within a heartbeat and
//!   its completion fenced); 200 (again for a job already cancelled, `was`
//!   `cancelled`, nothing appended), or 409 with the state if it ended otherwise.
//! - `GET /v1/kinds?minutes=`: every kind with its pause (who, when, why), the jobs waiting
//!   for its resume, its open jobs by state, what ended over the last `minutes` (60) with the
//!   wait and run times' p50 and p99, and its limits; `GET /v1/kinds/{kind}` one kind and its
//!   minutes. `GET /v1/history?minutes=`: the overview's minutes ([`crate::history`]). `POST /v1/kinds/{kind}/pause` and `POST /v1/kinds/{kind}/resume`
//!   (`{"reason": "...", "requested_by": "..."}`, optional): pause or resume a kind for the
//!   whole group; 200 with `paused`, `was_paused` and (resume) `dispatched`; 404 for a kind
//!   no processor registered. A paused kind's jobs wait unleased, their attempts unspent.
//! - `POST /v1/jobs/cancel`: cancels the open jobs a filter selects (`kind`, `document_id`,
//!   `state`, `since`, `until`; at least one), `batch_size` to a transaction, at most
//!   `limit`; `"dry_run": true` only counts them; 422 without a filter.
//! - `POST /v1/jobs/{id}/heartbeat` and `POST /v1/jobs/{id}/complete`: a handler over HTTP
//!   that answered `202` reports it is still working (`kind`, `generation`, `progress`) and
//!   how its attempt ended (`result`, or `error` with `status`, `message`, `retry_after`);
//!   200 while the job is leased at that generation, else 409 with its `state` and
//!   `generation` ([`crate::callback`]). Signed with the kind's `secret` when it has one.
//! - `POST /v1/jobs/{id}/run-now`: a scheduled job, or one waiting to retry, is due now and
//!   dispatched at once (no attempt spent or given); 200 with what it `waited` for
//!   (`scheduled`, `retry`, or `due`: a queued job already due, nothing done), 409 with the
//!   state for any other.
//! - `GET /v1/processors`: the processors of every group, as each last wrote its presence
//!   (every 3 s): partitions held, jobs running (the 50 longest-running named), last seen.
//! - `GET /v1/periodic`: the periodic schedules (`[periodic.<name>]`) with their next tick,
//!   the last one decided, its job or error, and the processor holding the schedules.
//! - `POST /v1/quarantine/replay`: replays the quarantined jobs a filter selects (`owner`,
//!   `kind`, `reason`, `since`, `until`), `batch_size` to a transaction, at most `limit`;
//!   `"dry_run": true` only counts them.
//! - `GET /v1/dead-letters?topic=&consumer_group=&after=&limit=`, `GET /v1/dead-letters/{id}`
//!   (raw key and value as hex and text), `POST /v1/dead-letters/{id}/reinject` (back to the
//!   intake topic), `DELETE /v1/dead-letters/{id}`; `DELETE /v1/dead-letters?topic=&
//!   consumer_group=&before=&dry_run=` deletes (or counts) a filter's letters.
//! - `GET /v1/jobs/{id}/input`, `GET /v1/jobs/{id}/result`: the job's input and its committed
//!   result as JSON (`?download=true` to save them as a file).
//! - `GET /v1/overview`: the unfinished-work gauges, recent rates and every partition's
//!   consumer lag, as the console shows them.
//! - `GET /v1/audit?actor=&action=&target=&before=&limit=`: the audit trail, newest first:
//!   every change made through the API or the CLI, who (the token's name), with which role,
//!   what, on what, when, and the request's id (`X-Request-Id`, given or made).
//! - `POST /v1/auth`: 200 with the token's `name` and `role` (the console's sign-in), 401 for
//!   a wrong one.
//! - `GET /ui`: the operator console ([`crate::console`]).
//! - `GET /metrics` (Prometheus), `GET /healthz` (the process runs), `GET /readyz`
//!   (Postgres answers).
//!
//! Who may call what: [`crate::access`]. In short: only listed `Host`s are answered (421);
//! a mutating request a browser sends from another origin is refused (403); with tokens
//! configured every route but the probes, the console's page and `/metrics` needs a token
//! whose role allows it — `read` reads, `submit` accepts jobs, `operate` changes them,
//! `admin` deletes. Every answer carries `X-Request-Id`.
//!
//! Errors are JSON: `{"error": {"code": "...", "message": "..."}}`.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use jobfold_common::accept::{AcceptError, Acceptor, NewJob};
use jobfold_schemas::event::{TRACEPARENT, TRACESTATE, TraceContext};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::callback::{Complete, Heartbeat};
use crate::status;
use crate::store::audit;

/// What every handler shares: a handle, cloned for each request (axum's `State`, each
/// middleware's), so a clone is one reference count, not a copy of the codecs, settings and
/// strings below.
#[derive(Debug, Clone)]
pub struct ApiState(std::sync::Arc<Shared>);

impl std::ops::Deref for ApiState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`ApiState`] points to.
#[derive(Debug)]
pub struct Shared {
    pub pool: PgPool,
    pub acceptor: Acceptor,
    /// Appends events (replays).
    pub events: crate::store::Events,
    pub policy: jobfold_common::config::AcceptPolicy,
    /// Who may call what ([`crate::access`]).
    pub access: std::sync::Arc<crate::access::Access>,
    /// Kafka settings and topics (re-injecting dead letters).
    pub config: std::sync::Arc<jobfold_common::config::Config>,
    /// Every partition's consumer lag (the overview).
    pub lag: crate::lag::LagReader,
    /// `POST /v1/jobs`'s group commit: the requests waiting at once share a transaction.
    accepts: crate::batch::Batcher<NewJob, Grouped>,
    /// One permit a request being handled (`http.max_concurrent_requests`).
    slots: std::sync::Arc<tokio::sync::Semaphore>,
    /// The group commit's tasks and the accepts running past their caller
    /// ([`durable_within`]): the server waits for them when it stops.
    work: crate::supervise::Work,
}

/// A job's answer from the group commit.
#[derive(Debug)]
enum Grouped {
    Answered(Result<jobfold_common::accept::Accepted, ApiError>),
    /// Its batch failed for one job's sake (a key another transaction holds, data Postgres
    /// refused in some row): each request accepts its job alone, so only that one waits or
    /// is refused, and the batcher goes on.
    Alone(NewJob),
}

/// Most jobs `POST /v1/jobs/batch` takes.
pub const MAX_BATCH_JOBS: usize = 1000;
/// Accept transactions `POST /v1/jobs`'s group commit runs at once at most: while one
/// commits, the requests arriving meanwhile gather for the next (fewer, larger transactions
/// cost less than many small ones); the second runs beside the first only when the first
/// is slow ([`ACCEPT_GATHER`]), so that one lock wait, at most a second, does not stop the
/// rest.
const ACCEPT_TRANSACTIONS: usize = 2;
/// How `POST /v1/jobs`'s group commit gathers a transaction's jobs
/// ([`crate::batch::Gather`]): one transaction at a time, the next waiting up to 2 ms for as
/// many jobs as the larger of the two before (keep-alive clients send again within a few
/// hundred microseconds to a couple of milliseconds of their answers), and a second beside
/// it only once the first has run 20 ms (a lock wait). 24 clients accepting alone (2 cores):
/// 24 jobs a transaction instead of 6.4 (half of them 1 or 2), the machine's CPU a job
/// 217–236 µs instead of 387–419, Postgres's 71–74 instead of 156–169.
const ACCEPT_GATHER: crate::batch::Gather = crate::batch::Gather {
    linger: std::time::Duration::from_millis(2),
    overtake: std::time::Duration::from_millis(20),
};

/// Accepts `jobs` in one transaction (the group commit); a failure of the whole batch is
/// each job's, or, if it failed for one job's sake, each is sent back to be accepted alone.
async fn accept_grouped(acceptor: &Acceptor, pool: &PgPool, jobs: Vec<NewJob>) -> Vec<Grouped> {
    match acceptor.accept_all_at_once(pool, &jobs).await {
        Ok(each) => each
            .into_iter()
            .map(|answer| Grouped::Answered(answer.map_err(ApiError::from)))
            .collect(),
        Err(e) if e.alone_helps() => {
            tracing::debug!(error = %e, jobs = jobs.len(), "An accept batch failed for one job's sake; each is accepted alone.");
            jobs.into_iter().map(Grouped::Alone).collect()
        }
        Err(e) => {
            let error = ApiError::from(e);
            jobs.iter().map(|_| Grouped::Answered(Err(error.clone()))).collect()
        }
    }
}

impl ApiState {
    /// The API's state over `pool`, accepting with `acceptor` and appending with `events`.
    pub fn new(
        pool: PgPool,
        acceptor: Acceptor,
        events: crate::store::Events,
        config: jobfold_common::config::Config,
    ) -> Self {
        let config = std::sync::Arc::new(config);
        let work = crate::supervise::Work::default();
        let accepts = {
            let (acceptor, pool) = (acceptor.clone(), pool.clone());
            crate::batch::Batcher::gathering(
                "http",
                MAX_BATCH_JOBS,
                ACCEPT_TRANSACTIONS,
                Some(ACCEPT_GATHER),
                &work,
                move |jobs: Vec<NewJob>| {
                    let (acceptor, pool) = (acceptor.clone(), pool.clone());
                    async move {
                        accept_grouped(&acceptor, &pool, jobs).await.into_iter().map(Ok).collect()
                    }
                },
            )
        };
        Self(std::sync::Arc::new(Shared {
            accepts,
            slots: std::sync::Arc::new(tokio::sync::Semaphore::new(
                config.http.max_concurrent_requests,
            )),
            pool,
            acceptor,
            events,
            policy: config.accept_policy(),
            access: std::sync::Arc::new(crate::access::Access::new(&config)),
            lag: crate::lag::LagReader::new(std::sync::Arc::clone(&config)),
            config,
            work,
        }))
    }

    /// The API's own tasks (the group commit's, the accepts still committing): once the
    /// server stopped and dropped its state, [`crate::supervise::Work::join`] waits for them.
    pub fn work(&self) -> crate::supervise::Work {
        self.work.clone()
    }
}

/// The API's routes; request bodies are limited to `max_body` bytes.
pub fn router(state: ApiState, max_body: usize) -> Router {
    Router::new()
        .route("/v1/jobs", post(submit).get(list_jobs))
        .route(
            "/v1/jobs/batch",
            post(submit_batch).layer(DefaultBodyLimit::max(state.config.accept.max_batch_bytes)),
        )
        .route("/v1/jobs/cancel", post(cancel_matching))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/jobs/{id}/input", get(job_input))
        .route("/v1/jobs/{id}/result", get(job_result))
        .route("/v1/overview", get(overview))
        .route("/v1/auth", post(auth))
        .route("/v1/audit", get(audit))
        .route("/v1/jobs/{id}/replay", post(replay))
        .route("/v1/jobs/{id}/cancel", post(cancel))
        .route("/v1/jobs/{id}/run-now", post(run_now))
        .route(
            "/v1/jobs/{id}/heartbeat",
            post(heartbeat).layer(DefaultBodyLimit::max(
                crate::callback::MAX_PROGRESS_BYTES + CALLBACK_OVERHEAD_BYTES,
            )),
        )
        .route(
            "/v1/jobs/{id}/complete",
            post(complete).layer(DefaultBodyLimit::max(
                largest_output(&state.config) + CALLBACK_OVERHEAD_BYTES,
            )),
        )
        .route("/v1/kinds", get(kinds))
        .route("/v1/periodic", get(periodic))
        .route("/v1/processors", get(processors))
        .route("/v1/kinds/{kind}/pause", post(pause_kind))
        .route("/v1/kinds/{kind}/resume", post(resume_kind))
        .route("/v1/quarantine", get(quarantine))
        .route("/v1/quarantine/groups", get(quarantine_groups))
        .route("/v1/quarantine/replay", post(replay_matching))
        .route("/v1/dead-letters", get(dead_letters).delete(delete_dead_letters))
        .route("/v1/history", get(history))
        .route("/v1/kinds/{kind}", get(kind))
        .route("/v1/dead-letters/{id}", get(dead_letter).delete(delete_dead_letter))
        .route("/v1/dead-letters/{id}/reinject", post(reinject_dead_letter))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .merge(crate::console::routes())
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(middleware::from_fn_with_state(state.clone(), bounded))
        .with_state(state)
}

/// Holds every request but the health checks and `/metrics` to `http.request_timeout`, its
/// body's upload included (408 `request_timeout`), and to `http.max_concurrent_requests`
/// handled at once: one more is answered 503 `overloaded` at once, not queued, so a flood
/// (or slow uploads) costs its senders a retry and nobody else their memory. Both are
/// counted in `jobfold_http_refused_total` (`timeout`, `overloaded`).
async fn bounded(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    if matches!(request.uri().path(), "/healthz" | "/readyz" | "/metrics") {
        return next.run(request).await;
    }
    let http = &state.config.http;
    let Ok(_slot) = std::sync::Arc::clone(&state.slots).try_acquire_owned() else {
        metrics::counter!(crate::metrics::HTTP_REFUSED_TOTAL, "reason" => "overloaded")
            .increment(1);
        let message = format!(
            "{} requests are being handled (http.max_concurrent_requests); try again shortly",
            http.max_concurrent_requests
        );
        return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
            .into_response();
    };
    match tokio::time::timeout(http.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            metrics::counter!(crate::metrics::HTTP_REFUSED_TOTAL, "reason" => "timeout")
                .increment(1);
            let message = format!(
                "the request took longer than http.request_timeout ({}): what it asked may or \
                 may not have happened; an accept can be retried with its idempotency key",
                humantime::format_duration(http.request_timeout)
            );
            ApiError::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", message).into_response()
        }
    }
}

/// What a callback's body holds besides its progress or result.
const CALLBACK_OVERHEAD_BYTES: usize = 16 * 1024;

/// The largest result any kind may complete with.
fn largest_output(config: &jobfold_common::config::Config) -> usize {
    config
        .kinds
        .keys()
        .map(|kind| config.kind(kind).max_output_bytes)
        .fold(config.processor.max_output_bytes, usize::max)
}

/// Who made a request that passed the access check, and the request's id: what the audit
/// trail records of a change.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: crate::access::Principal,
    pub request_id: String,
    /// Whether the principal was named by a token (else `anonymous`: no token configured).
    pub authenticated: bool,
}

impl Caller {
    /// The actor the audit trail records.
    pub fn actor(&self) -> crate::store::audit::Actor {
        crate::store::audit::Actor {
            name: self.principal.name.clone(),
            role: self.authenticated.then(|| self.principal.role.to_string()),
            via: crate::store::audit::Via::Api,
            request_id: Some(self.request_id.clone()),
        }
    }

    /// Who a change is recorded as requested by: the token's name once a token named the
    /// caller (what a body says is kept in the audit row's detail), else what the body says.
    fn requested_by(&self, said: Option<String>) -> Option<String> {
        if self.authenticated { Some(self.principal.name.clone()) } else { said }
    }
}

/// Longest `X-Request-Id` taken from a request; a longer or odd one is replaced.
const REQUEST_ID_MAX: usize = 128;

/// The request's id: its `X-Request-Id` if that is 1 to 128 visible ASCII characters, else a
/// new one.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| {
            !v.is_empty() && v.len() <= REQUEST_ID_MAX && v.bytes().all(|b| b.is_ascii_graphic())
        })
        .map_or_else(|| Uuid::new_v4().to_string(), str::to_owned)
}

/// Lets a request through only as [`crate::access`] says (host, origin, token and role),
/// with its [`Caller`]; marks every answer `nosniff`, so a browser never reads a JSON body
/// (user data) as a page or a script, and with its `X-Request-Id`.
async fn authorize(State(state): State<ApiState>, mut request: Request, next: Next) -> Response {
    let id = request_id(request.headers());
    let mut response = match admit(&state, &request, &id) {
        Err(refusal) => *refusal,
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
    };
    let headers = response.headers_mut();
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    if let Ok(value) = header::HeaderValue::from_str(&id) {
        headers.insert("x-request-id", value);
    }
    response
}

/// The caller, if the request may pass; else the refusal to answer.
fn admit(state: &ApiState, request: &Request, request_id: &str) -> Result<Caller, Box<Response>> {
    let (method, path) = (request.method(), request.uri().path());
    let access = &state.access;
    if path != "/healthz" && path != "/readyz" {
        check_host(access, request)?;
    }
    let mutating = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    if mutating && let Some(origin) = cross_origin(request.headers()) {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "cross_origin",
            "origin",
            format!("a mutating request from {origin} is refused: send it from this origin"),
        ));
    }
    let needs = access.required(method, path);
    // A signed callback is authenticated by its signature, checked with its kind's secret
    // by the route itself.
    let signed_callback = *method == Method::POST
        && request.headers().contains_key(crate::signature::HEADER)
        && crate::access::is_callback(path);
    if !access.tokens_required() || (needs.is_none() && path != "/v1/auth") || signed_callback {
        return Ok(Caller {
            principal: crate::access::Principal::anonymous(),
            request_id: request_id.to_owned(),
            authenticated: false,
        });
    }
    let principal = authenticate(access, request)?;
    if let Some(needs) = needs
        && principal.role < needs
    {
        return Err(refused(
            StatusCode::FORBIDDEN,
            "forbidden",
            "role",
            format!(
                "token {} has the role {}; {method} {path} needs {needs}",
                principal.name, principal.role
            ),
        ));
    }
    Ok(Caller { principal, request_id: request_id.to_owned(), authenticated: true })
}

/// A refusal before any handler ran, counted by `reason` in `jobfold_http_refused_total`.
fn refused(
    status: StatusCode,
    code: &'static str,
    reason: &'static str,
    message: String,
) -> Box<Response> {
    metrics::counter!(crate::metrics::HTTP_REFUSED_TOTAL, "reason" => reason).increment(1);
    Box::new(ApiError::new(status, code, message).into_response())
}

/// The request's `Host` (or its URI's authority) must be one `http.allowed_hosts` lists: a
/// DNS rebinding page sends its own.
fn check_host(access: &crate::access::Access, request: &Request) -> Result<(), Box<Response>> {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(axum::http::uri::Authority::as_str));
    match host {
        Some(host) if access.host_allowed(host) => Ok(()),
        host => {
            let shown: String = host.unwrap_or("(none)").chars().take(100).collect();
            Err(refused(
                StatusCode::MISDIRECTED_REQUEST,
                "host_not_allowed",
                "host",
                format!("this API does not answer to Host {shown}: list it in http.allowed_hosts"),
            ))
        }
    }
}

/// Who sent the request, by its bearer token: 401 without a valid one, 429 (with
/// `Retry-After`) for an address past `http.auth_failures_per_minute`.
fn authenticate(
    access: &crate::access::Access,
    request: &Request,
) -> Result<crate::access::Principal, Box<Response>> {
    use crate::access::Refusal;
    let client =
        request.extensions().get::<axum::extract::ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
    let authorization = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match access.authenticate(client, authorization) {
        Ok(principal) => Ok(principal),
        Err(Refusal::TooManyFailures(wait)) => {
            let mut response = refused(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_failed_authentications",
                "failures",
                "too many failed authentications from this address: try again later".into(),
            );
            let secs = wait.as_secs().max(1).to_string();
            if let Ok(value) = header::HeaderValue::from_str(&secs) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            Err(response)
        }
        Err(_) => {
            let mut response = refused(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "token",
                "this request needs the header Authorization: Bearer <token>".into(),
            );
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            Err(response)
        }
    }
}

/// The origin a browser says it sends this request from, if that is not this host: an
/// `Origin` whose host and port differ from `Host`, or `Sec-Fetch-Site: cross-site`.
/// Clients that are not browsers send neither and pass.
fn cross_origin(headers: &HeaderMap) -> Option<String> {
    let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if value("sec-fetch-site") == Some("cross-site") {
        return Some(value("origin").unwrap_or("another site").to_owned());
    }
    let origin = value("origin")?;
    // A sandboxed page or a privacy-sensitive redirect says `null`: never this origin.
    let authority = origin.split_once("://").map(|(_, rest)| rest);
    let host = value("host");
    match (authority, host) {
        (Some(authority), Some(host)) if authority.eq_ignore_ascii_case(host) => None,
        _ => Some(origin.to_owned()),
    }
}

/// Serves the API on `addr` until `shutdown` is cancelled.
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(address = %addr, "HTTP API listening.");
    serve_on(listener, router, shutdown).await
}

/// Serves the API on `listener` until `shutdown` is cancelled, each request knowing its
/// client's address (failed authentications are counted by it).
///
/// # Errors
/// Accepting failed.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    Ok(())
}

/// An API error: a status and a JSON body naming what went wrong.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// More fields of the error object, e.g. the `state` of a job that already ended.
    details: serde_json::Map<String, serde_json::Value>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), details: Default::default() }
    }

    fn with(mut self, field: &str, value: impl Into<serde_json::Value>) -> Self {
        self.details.insert(field.to_owned(), value.into());
        self
    }
}

impl ApiError {
    /// The error object: `code`, `message` and the details.
    fn body(self) -> serde_json::Value {
        let mut error = self.details;
        error.insert("code".into(), self.code.into());
        error.insert("message".into(), self.message.into());
        serde_json::Value::Object(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let mut response = (status, axum::Json(json!({ "error": self.body() }))).into_response();
        // The database (or a standby it waits for) is away: a second is the time a failover
        // takes to be noticed.
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// `accept`'s answer if it is durable within `limit` (`accept.commit_timeout`), else 503
/// `not_durable_yet`. The accept runs in a task of its own (in `work`, which a stopping
/// server waits for) and goes on past the limit: a commit that waits for the synchronous
/// standby must not be cancelled or its connection dropped, for Postgres then keeps it
/// committed locally without the standby having it (a job a failover would lose, though it
/// may already have run). The caller retries with its idempotency key and is answered 200
/// once the commit ends.
async fn durable_within<T: Send + 'static>(
    work: &crate::supervise::Work,
    limit: std::time::Duration,
    accept: impl Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    let task = work.spawn("accept", accept);
    match tokio::time::timeout(limit, task).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(join)) => {
            tracing::error!(error = %join, "An accept task failed.");
            Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the accept failed"))
        }
        Err(_) => {
            metrics::counter!(crate::metrics::ACCEPTS_NOT_DURABLE_TOTAL).increment(1);
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_durable_yet",
                format!(
                    "the accept was not durable within accept.commit_timeout ({}): the database \
                     or its synchronous standby is slow or away; retry with the same \
                     Idempotency-Key",
                    humantime::format_duration(limit)
                ),
            ))
        }
    }
}

/// A body that does not parse: 422 naming the field.
fn invalid_body(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let message = if path == "." {
        format!("invalid body: {}", e.inner())
    } else {
        format!("invalid field `{path}`: {}", e.inner())
    };
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", message)
}

/// An optional JSON body: the type's default when empty.
fn optional_body<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(deserializer).map_err(invalid_body)
}

/// A query string that does not parse: 400 naming the parameter.
fn bad_query(e: QueryRejection) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_query", e.body_text())
}

impl From<AcceptError> for ApiError {
    fn from(e: AcceptError) -> Self {
        match e {
            AcceptError::Invalid { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", e.to_string())
            }
            AcceptError::TooLarge { .. } => {
                Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", e.to_string())
            }
            AcceptError::Unstorable { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unstorable", e.to_string())
            }
            AcceptError::UnknownKind { .. } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unknown_kind", e.to_string())
            }
            AcceptError::Conflict { .. } => {
                Self::new(StatusCode::CONFLICT, "idempotency_key_reused", e.to_string())
            }
            AcceptError::Encode(_) => {
                tracing::error!(error = %e, "Encoding an event failed.");
                Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "encoding the event failed",
                )
            }
            AcceptError::Database(_) => {
                tracing::warn!(error = %e, "Accept failed in the database.");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "the database is unavailable",
                )
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        tracing::warn!(error = %e, "Database query failed.");
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the database is unavailable")
    }
}

/// The body of `POST /v1/jobs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitBody {
    document_id: String,
    kind: String,
    input_version: i64,
    input: serde_json::Value,
    /// Not before this instant (RFC 3339).
    #[serde(default)]
    run_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Not before this long from now (`90s`, `15m`, `2h`): `run_at` relative to the accept.
    #[serde(default)]
    delay: Option<String>,
    /// Retries of the same request carry the same key (or the `Idempotency-Key` header).
    #[serde(default)]
    idempotency_key: Option<String>,
}

impl SubmitBody {
    /// The job this body asks for, with `header_key` (the `Idempotency-Key` header) if the
    /// body names none.
    fn into_job(
        self,
        header_key: Option<String>,
        trace: Option<TraceContext>,
    ) -> Result<NewJob, ApiError> {
        let invalid = |message: String| {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", message)
        };
        let run_at = match (self.run_at, self.delay) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "invalid field `delay`: give run_at or delay, not both".into(),
                ));
            }
            (run_at, None) => run_at,
            (None, Some(delay)) => {
                let delay = humantime::parse_duration(&delay).map_err(|e| {
                    invalid(format!("invalid field `delay`: {e} (e.g. 90s, 15m, 2h)"))
                })?;
                let delay = chrono::Duration::from_std(delay)
                    .map_err(|_| invalid("invalid field `delay`: too long".into()))?;
                chrono::Utc::now().checked_add_signed(delay)
            }
        };
        let idempotency_key = match (self.idempotency_key, header_key) {
            (Some(body), Some(header)) if body != header => {
                return Err(invalid(
                    "invalid field `idempotency_key`: differs from the Idempotency-Key header"
                        .into(),
                ));
            }
            (body, header) => body.or(header),
        };
        Ok(NewJob {
            document_id: self.document_id,
            kind: self.kind,
            input_version: self.input_version,
            input: self.input,
            idempotency_key,
            trace,
            run_at,
        })
    }
}

/// The body of `POST /v1/jobs/batch`: each job as `POST /v1/jobs` takes it, parsed on its
/// own so that a malformed one fails only itself.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    jobs: Vec<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct Submitted {
    job_id: Uuid,
    created: bool,
}

/// The W3C trace context of the request, if it sent a valid one.
fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    let traceparent = headers.get(TRACEPARENT)?.to_str().ok()?;
    let tracestate = headers.get(TRACESTATE).and_then(|v| v.to_str().ok());
    TraceContext::from_headers(traceparent, tracestate)
}

/// A request body, parsed, if it is JSON and within its limit.
fn json_body<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    what: &str,
) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| {
        let status = rejection.status();
        let code =
            if status == StatusCode::PAYLOAD_TOO_LARGE { "payload_too_large" } else { "bad_body" };
        ApiError::new(status, code, rejection.body_text())
    })?;
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_media_type);
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!("send {what} as Content-Type: application/json"),
        ));
    }
    let deserializer = &mut serde_json::Deserializer::from_slice(&body);
    serde_path_to_error::deserialize(deserializer).map_err(invalid_body)
}

async fn submit(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let parsed: SubmitBody = json_body(&headers, body, "the job")?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().map(str::to_owned).map_err(|_| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                "invalid header `Idempotency-Key`: must be visible ASCII",
            )
        })?),
    };
    let job = parsed.into_job(idempotency_key, trace_context(&headers))?;
    let (limit, work) = (state.config.accept.commit_timeout, state.work.clone());
    let accepted = durable_within(&work, limit, async move {
        let grouped = state.accepts.submit(job).await.map_err(|e| {
            tracing::error!(error = %format!("{e:#}"), "The accept batch failed.");
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "the accept failed")
        })?;
        match grouped {
            Grouped::Answered(answer) => answer,
            Grouped::Alone(job) => Ok(state.acceptor.accept(&state.pool, &job).await?),
        }
    })
    .await?;
    let status = if accepted.created { StatusCode::CREATED } else { StatusCode::OK };
    let location = format!("/v1/jobs/{}", accepted.job_id);
    let body = Submitted { job_id: accepted.job_id, created: accepted.created };
    Ok((status, [(header::LOCATION, location)], axum::Json(body)).into_response())
}

async fn submit_batch(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let batch: BatchBody = json_body(&headers, body, "the batch")?;
    if batch.jobs.is_empty() || batch.jobs.len() > MAX_BATCH_JOBS {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            format!(
                "invalid field `jobs`: must hold 1 to {MAX_BATCH_JOBS} jobs, not {}",
                batch.jobs.len()
            ),
        ));
    }
    let trace = trace_context(&headers);
    let mut answers: Vec<Option<Result<jobfold_common::accept::Accepted, ApiError>>> =
        Vec::with_capacity(batch.jobs.len());
    let mut jobs = Vec::with_capacity(batch.jobs.len());
    for (i, item) in batch.jobs.into_iter().enumerate() {
        let parsed = serde_path_to_error::deserialize::<_, SubmitBody>(item)
            .map_err(|e| {
                let path = e.path().to_string();
                let field =
                    if path == "." { format!("jobs[{i}]") } else { format!("jobs[{i}].{path}") };
                ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "invalid_field",
                    format!("invalid field `{field}`: {}", e.inner()),
                )
            })
            .and_then(|parsed| parsed.into_job(None, trace.clone()));
        match parsed {
            Ok(job) => {
                jobs.push(job);
                answers.push(None);
            }
            Err(e) => answers.push(Some(Err(e))),
        }
    }
    // A failure of the whole batch (the database) is one answer, as for a single job.
    let (limit, work) = (state.config.accept.commit_timeout, state.work.clone());
    let mut accepted = durable_within(&work, limit, async move {
        Ok(state.acceptor.accept_each(&state.pool, &jobs).await?)
    })
    .await?
    .into_iter();
    let (mut created, mut existing, mut failed) = (0, 0, 0);
    // The jobs that parsed take their answers from accept_each, in order.
    let results: Vec<serde_json::Value> = answers
        .into_iter()
        .filter_map(|answer| answer.or_else(|| Some(accepted.next()?.map_err(ApiError::from))))
        .map(|answer| match answer {
            Ok(a) => {
                if a.created {
                    created += 1;
                } else {
                    existing += 1;
                }
                let status = if a.created { 201 } else { 200 };
                json!({ "status": status, "job_id": a.job_id, "created": a.created })
            }
            Err(e) => {
                failed += 1;
                json!({ "status": e.status.as_u16(), "error": e.body() })
            }
        })
        .collect();
    let body =
        json!({ "created": created, "existing": existing, "failed": failed, "jobs": results });
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

/// `application/json`, with or without parameters (`; charset=utf-8`); not
/// `application/jsonx` nor `text/json`.
fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
}

/// Any path the API does not serve: the JSON error shape, 404.
async fn no_route(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no route {method} {}", uri.path()))
}

/// A served path with a method it does not take: the JSON error shape, 405.
async fn wrong_method(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not take {method}", uri.path()),
    )
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}"))
}

async fn job(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<status::JobStatus>, ApiError> {
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found(&id))?;
    let view = status::job(&state.pool, job_id).await?;
    view.map(axum::Json).ok_or_else(|| not_found(&id))
}

async fn job_events(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<Vec<status::EventEntry>>, ApiError> {
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found(&id))?;
    match status::events(&state.pool, state.events.codec.decoder(), job_id).await {
        Ok(Some(events)) => Ok(axum::Json(events)),
        Ok(None) => Err(not_found(&id)),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), %job_id, "Reading the event history failed.");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the event history cannot be read now (database or schema registry)",
            ))
        }
    }
}

/// `?download=true`: answer as a file to save.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Download {
    #[serde(default)]
    download: bool,
}

/// `value` as a JSON answer; with `download`, as a file named `name`.
fn json_document(value: &serde_json::Value, download: bool, name: String) -> Response {
    let body = serde_json::to_vec_pretty(value).unwrap_or_default();
    let mut response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
    if download {
        let disposition = format!("attachment; filename=\"{name}\"");
        if let Ok(value) = header::HeaderValue::from_str(&disposition) {
            response.headers_mut().insert(header::CONTENT_DISPOSITION, value);
        }
    }
    response
}

async fn job_input(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    query: Result<Query<Download>, QueryRejection>,
) -> Result<Response, ApiError> {
    job_document(&state, &id, query, "input").await
}

async fn job_result(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    query: Result<Query<Download>, QueryRejection>,
) -> Result<Response, ApiError> {
    job_document(&state, &id, query, "result").await
}

/// A job's `input` or its committed `result`, as JSON or as a file to save.
async fn job_document(
    state: &ApiState,
    id: &str,
    query: Result<Query<Download>, QueryRejection>,
    which: &'static str,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    let job_id = Uuid::parse_str(id).map_err(|_| not_found(id))?;
    let document = if which == "input" {
        status::input(&state.pool, job_id).await?.ok_or_else(|| not_found(id))?
    } else {
        status::result(&state.pool, job_id).await?.ok_or_else(|| not_found(id))?.ok_or_else(
            || ApiError::new(StatusCode::NOT_FOUND, "no_result", format!("job {id} has no result")),
        )?
    };
    Ok(json_document(&document, query.download, format!("{job_id}-{which}.json")))
}

/// How long the overview waits for the consumer lag.
const LAG_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The overview and every partition's lag; a lag Kafka cannot tell now is an error field,
/// not a failed overview.
async fn overview(
    State(state): State<ApiState>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let overview = status::overview(&state.pool).await?;
    let mut body = serde_json::to_value(overview).unwrap_or_default();
    // Postgres's figures do not wait for a broker that is down.
    let lag = tokio::time::timeout(LAG_WAIT, state.lag.read()).await.unwrap_or_else(|_| {
        Err(anyhow::anyhow!("Kafka did not answer within {}s", LAG_WAIT.as_secs()))
    });
    match lag {
        Ok(lag) => body["consumer_lag"] = json!(lag),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "Reading the consumer lag failed.");
            body["consumer_lag"] = json!([]);
            body["consumer_lag_error"] = json!(format!("{e:#}"));
        }
    }
    body["token_required"] = json!(state.access.tokens_required());
    body["trace_url"] = json!(state.config.console.trace_url);
    Ok(axum::Json(body))
}

async fn quarantine(
    State(state): State<ApiState>,
    filter: Result<Query<status::QuarantineFilter>, QueryRejection>,
) -> Result<axum::Json<Vec<status::Quarantined>>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    Ok(axum::Json(status::quarantined(&state.pool, &filter).await?))
}

async fn quarantine_groups(
    State(state): State<ApiState>,
    filter: Result<Query<status::QuarantineFilter>, QueryRejection>,
) -> Result<axum::Json<Vec<status::QuarantineGroup>>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    Ok(axum::Json(status::quarantine_groups(&state.pool, &filter).await?))
}

async fn list_jobs(
    State(state): State<ApiState>,
    filter: Result<Query<status::JobFilter>, QueryRejection>,
) -> Result<axum::Json<status::JobPage>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    Ok(axum::Json(status::jobs(&state.pool, &filter).await?))
}

/// `POST /v1/jobs/{id}/heartbeat`: a handler that answered 202 is still working.
async fn heartbeat(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (job_id, beat) =
        callback_body(&state, &caller, &id, (&headers, &body), |b: &Heartbeat| &b.kind)?;
    if let Some(progress) = &beat.progress {
        let size = serde_json::to_vec(progress).map_or(usize::MAX, |b| b.len());
        if size > crate::callback::MAX_PROGRESS_BYTES {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "progress_too_large",
                format!(
                    "progress is {size} bytes as JSON, more than {}",
                    crate::callback::MAX_PROGRESS_BYTES
                ),
            ));
        }
    }
    let fenced = crate::callback::call_back(
        &state.pool,
        job_id,
        &beat.kind,
        beat.generation,
        beat.progress.as_ref(),
        None,
    )
    .await?;
    called_back("heartbeat", job_id, beat.generation, fenced)
}

/// `POST /v1/jobs/{id}/complete`: how the attempt of a handler that answered 202 ended.
async fn complete(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (job_id, done) =
        callback_body(&state, &caller, &id, (&headers, &body), |c: &Complete| &c.kind)?;
    let (kind, generation) = (done.kind.clone(), done.generation);
    let outcome = crate::callback::outcome_of(done)
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_completion", e))?;
    let fenced =
        crate::callback::call_back(&state.pool, job_id, &kind, generation, None, Some(&outcome))
            .await?;
    called_back("complete", job_id, generation, fenced)
}

/// A callback's job and body: the id parsed, the body (required) read as `T` and signed by
/// the kind it names (`kind`), or let through for a kind without a secret.
fn callback_body<T: serde::de::DeserializeOwned>(
    state: &ApiState,
    caller: &Caller,
    id: &str,
    (headers, body): (&HeaderMap, &[u8]),
    kind: fn(&T) -> &str,
) -> Result<(Uuid, T), ApiError> {
    let job_id = Uuid::parse_str(id).map_err(|_| not_found(id))?;
    let deserializer = &mut serde_json::Deserializer::from_slice(body);
    let call: T = serde_path_to_error::deserialize(deserializer).map_err(invalid_body)?;
    signed_by_kind(state, caller, kind(&call), headers, body)?;
    Ok((job_id, call))
}

/// A callback for `kind` passes if it is signed with the kind's secret; for a kind without
/// one, if the access check let it through on a token (or the API is open).
fn signed_by_kind(
    state: &ApiState,
    caller: &Caller,
    kind: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), ApiError> {
    let signature = headers.get(crate::signature::HEADER).and_then(|v| v.to_str().ok());
    let refused = |message: String| {
        metrics::counter!(crate::metrics::HTTP_REFUSED_TOTAL, "reason" => "signature").increment(1);
        ApiError::new(StatusCode::UNAUTHORIZED, "bad_signature", message)
    };
    match state.config.kinds.get(kind).and_then(|k| k.secret.as_ref()) {
        Some(secret) => crate::signature::verify(
            secret.expose().as_bytes(),
            signature,
            body,
            chrono::Utc::now().timestamp(),
        )
        .map_err(|e| refused(format!("kind {kind}: {e}"))),
        None if state.access.tokens_required() && !caller.authenticated => Err(refused(format!(
            "kind {kind} has no secret: its callbacks need a token (Authorization: Bearer)"
        ))),
        None => Ok(()),
    }
}

/// The answer to a callback.
fn called_back(
    route: &'static str,
    job_id: Uuid,
    generation: i64,
    fenced: crate::callback::Fenced,
) -> Result<Response, ApiError> {
    use crate::callback::Fenced;
    metrics::counter!(crate::metrics::CALLBACKS_TOTAL, "route" => route, "outcome" => match &fenced {
        Fenced::Written => "written",
        Fenced::Refused { .. } => "refused",
        Fenced::NotFound => "not_found",
    })
    .increment(1);
    match fenced {
        Fenced::Written => Ok((
            StatusCode::OK,
            axum::Json(json!({ "job_id": job_id, "generation": generation, "recorded": true })),
        )
            .into_response()),
        Fenced::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no job {job_id} of this kind"),
        )),
        Fenced::Refused { state, generation: now } => {
            let message = if now != generation {
                format!(
                    "generation {generation} is not the job's current {now}: this attempt's \
                     lease was lost; stop working on it"
                )
            } else if state == "leased" {
                "the attempt was already completed with another outcome".to_owned()
            } else {
                format!("the job is {state}: stop working on it")
            };
            Err(ApiError::new(StatusCode::CONFLICT, "not_leased", message)
                .with("state", state)
                .with("generation", now))
        }
    }
}

async fn cancel(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    use crate::store::CancelError;
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found(&id))?;
    let mut request: crate::store::Cancel = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    let mut tx = state.pool.begin().await?;
    let (job, was) = match crate::store::cancel(&mut tx, &state.events, job_id, request).await {
        Ok(cancelled) => cancelled,
        Err(CancelError::NotFound(_)) => return Err(not_found(&id)),
        Err(e @ CancelError::Ended { state, .. }) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "job_ended", e.to_string())
                .with("state", state.as_str()));
        }
        Err(CancelError::Database(e)) => return Err(e.into()),
        Err(CancelError::Other(e)) => {
            tracing::error!(error = %format!("{e:#}"), %job_id, "Cancel failed.");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "cancel failed",
            ));
        }
    };
    if was != jobfold_schemas::fold::Status::Cancelled {
        let detail = json!({ "was": was.as_str(), "request": said(&body) });
        let target = job_id.to_string();
        audit::record(&mut *tx, &caller.actor(), "cancel", Some(&target), detail).await?;
    }
    tx.commit().await?;
    if was != jobfold_schemas::fold::Status::Cancelled {
        crate::internal_events::JobCancelled { job_id: job.job_id, was: was.as_str() }.emit();
    }
    let body = json!({ "job_id": job.job_id, "state": job.state.as_str(), "was": was.as_str() });
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

async fn cancel_matching(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<axum::Json<crate::store::BulkCancelled>, ApiError> {
    use crate::store::BulkCancelError;
    let mut request: crate::store::BulkCancel = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    match crate::store::cancel_matching(&state.pool, &state.events, request).await {
        Ok(done) => {
            if !done.dry_run {
                let detail = json!({ "request": said(&body), "done": done });
                audited(&state.pool, &caller, "cancel_matching", None, detail).await;
            }
            Ok(axum::Json(done))
        }
        Err(e @ (BulkCancelError::NoFilter | BulkCancelError::State(_))) => {
            Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", e.to_string()))
        }
        Err(BulkCancelError::Database(e)) => Err(e.into()),
        Err(BulkCancelError::Other(e)) => {
            tracing::error!(error = %format!("{e:#}"), "Bulk cancel failed.");
            Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "bulk cancel failed"))
        }
    }
}

async fn run_now(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    use crate::store::RunNowError;
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found(&id))?;
    let mut tx = state.pool.begin().await?;
    let (job, waited) = match crate::store::run_now(&mut tx, &state.events, job_id).await {
        Ok(done) => done,
        Err(RunNowError::NotFound(_)) => return Err(not_found(&id)),
        Err(e @ RunNowError::NotWaiting { state, .. }) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "not_waiting", e.to_string())
                .with("state", state.as_str()));
        }
        Err(RunNowError::Database(e)) => return Err(e.into()),
        Err(RunNowError::Other(e)) => {
            tracing::error!(error = %format!("{e:#}"), %job_id, "Run-now failed.");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "run-now failed",
            ));
        }
    };
    if waited != crate::store::Waited::Due {
        let detail = json!({ "waited": waited });
        let target = job_id.to_string();
        audit::record(&mut *tx, &caller.actor(), "run_now", Some(&target), detail).await?;
    }
    tx.commit().await?;
    let body = json!({ "job_id": job.job_id, "state": job.state.as_str(), "waited": waited });
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

async fn periodic(
    State(state): State<ApiState>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let schedules = crate::periodic::schedules(&state.config, &state.pool).await?;
    Ok(axum::Json(json!({ "schedules": schedules })))
}

async fn processors(
    State(state): State<ApiState>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let processors = crate::presence::list(&state.pool).await?;
    Ok(axum::Json(json!({ "processors": processors })))
}

/// Minutes of history a page may ask for: a day, what is kept.
const HISTORY_MINUTES_MAX: i64 = 24 * 60;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryQuery {
    minutes: Option<i64>,
}

impl HistoryQuery {
    fn minutes(&self) -> Result<i64, ApiError> {
        match self.minutes.unwrap_or(60) {
            m @ 1..=HISTORY_MINUTES_MAX => Ok(m),
            m => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_query",
                format!("minutes must be 1 to {HISTORY_MINUTES_MAX}, not {m}"),
            )),
        }
    }
}

/// The overview's minutes: accepted, ended, the gauges as each minute ended.
async fn history(
    State(state): State<ApiState>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    let minutes = query.minutes()?;
    let points = crate::history::overview(&state.pool, minutes).await?;
    Ok(axum::Json(json!({ "minutes": minutes, "points": points })))
}

/// Every kind with its pause, its open jobs by state, what ended over the last `minutes`
/// (60) and its times, and its limits as configured.
async fn kinds(
    State(state): State<ApiState>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    let minutes = query.minutes()?;
    let (kinds, _) = kind_figures(&state, minutes, None).await?;
    Ok(axum::Json(json!({ "minutes": minutes, "kinds": kinds })))
}

/// One kind as `GET /v1/kinds` shows it, and its minutes.
async fn kind(
    State(state): State<ApiState>,
    Path(kind): Path<String>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let Query(query) = query.map_err(bad_query)?;
    let minutes = query.minutes()?;
    let (kinds, series) = kind_figures(&state, minutes, Some(&kind)).await?;
    let Some(found) = kinds.into_iter().find(|k| k["kind"] == kind.as_str()) else {
        let shown: String = kind.chars().take(200).collect();
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_kind",
            format!("no kind {shown:?} was registered, paused or run"),
        ));
    };
    Ok(axum::Json(json!({ "minutes": minutes, "kind": found, "series": series })))
}

async fn kind_figures(
    state: &ApiState,
    minutes: i64,
    series_of: Option<&str>,
) -> Result<(Vec<serde_json::Value>, Vec<crate::history::KindPoint>), ApiError> {
    Ok(crate::history::kind_table(&state.pool, &state.config, minutes, series_of).await?)
}

async fn pause_kind(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(kind): Path<String>,
    body: Bytes,
) -> Result<axum::Json<crate::store::kinds::KindChanged>, ApiError> {
    let mut request: crate::store::kinds::KindControl = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    let changed =
        crate::store::kinds::pause(&state.pool, &kind, request).await.map_err(kind_error)?;
    let detail = json!({ "request": said(&body), "done": changed });
    audited(&state.pool, &caller, "pause_kind", Some(&kind), detail).await;
    Ok(axum::Json(changed))
}

async fn resume_kind(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(kind): Path<String>,
    body: Bytes,
) -> Result<axum::Json<crate::store::kinds::KindChanged>, ApiError> {
    let mut request: crate::store::kinds::KindControl = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    let changed = crate::store::kinds::resume(&state.pool, &state.events, &kind, request).await;
    let changed = changed.map_err(kind_error)?;
    let detail = json!({ "request": said(&body), "done": changed });
    audited(&state.pool, &caller, "resume_kind", Some(&kind), detail).await;
    Ok(axum::Json(changed))
}

fn kind_error(e: crate::store::kinds::KindError) -> ApiError {
    use crate::store::kinds::KindError;
    match e {
        KindError::Unknown { .. } => {
            ApiError::new(StatusCode::NOT_FOUND, "unknown_kind", e.to_string())
        }
        KindError::TooLong { .. } => {
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", e.to_string())
        }
        KindError::Database(e) => e.into(),
        KindError::Other(e) => {
            tracing::error!(error = %format!("{e:#}"), "Resuming a kind failed.");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "resume failed")
        }
    }
}

async fn replay_matching(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<axum::Json<crate::store::BulkReplayed>, ApiError> {
    let mut request: crate::store::BulkReplay = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    match crate::store::replay_matching(&state.pool, &state.events, &state.policy, request).await {
        Ok(done) => {
            if !done.dry_run {
                let detail = json!({ "request": said(&body), "done": done });
                audited(&state.pool, &caller, "replay_matching", None, detail).await;
            }
            Ok(axum::Json(done))
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "Bulk replay failed.");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                format!("bulk replay stopped: {e:#} (batches committed before stay replayed)"),
            ))
        }
    }
}

fn no_dead_letter(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no dead letter {id}"))
}

async fn dead_letters(
    State(state): State<ApiState>,
    filter: Result<Query<crate::dead_letter::DeadLetterFilter>, QueryRejection>,
) -> Result<axum::Json<crate::dead_letter::DeadLetterPage>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    Ok(axum::Json(crate::dead_letter::list(&state.pool, &filter).await?))
}

async fn dead_letter(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<crate::dead_letter::DeadLetterDetail>, ApiError> {
    let n: i64 = id.parse().map_err(|_| no_dead_letter(&id))?;
    crate::dead_letter::show(&state.pool, n)
        .await?
        .map(axum::Json)
        .ok_or_else(|| no_dead_letter(&id))
}

/// Deletes the dead letters a filter selects, or counts them (`dry_run=true`).
async fn delete_dead_letters(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    filter: Result<Query<crate::dead_letter::DeleteFilter>, QueryRejection>,
) -> Result<axum::Json<crate::dead_letter::Deleted>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    let done = crate::dead_letter::delete_matching(&state.pool, &filter).await?;
    if !done.dry_run {
        let detail = json!({ "filter": {
            "topic": filter.topic, "consumer_group": filter.consumer_group, "before": filter.before,
        }, "done": done });
        audited(&state.pool, &caller, "delete_dead_letters", None, detail).await;
    }
    Ok(axum::Json(done))
}

async fn delete_dead_letter(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let n: i64 = id.parse().map_err(|_| no_dead_letter(&id))?;
    if crate::dead_letter::delete(&state.pool, n).await? {
        audited(&state.pool, &caller, "delete_dead_letter", Some(&id), json!({})).await;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(no_dead_letter(&id))
    }
}

async fn reinject_dead_letter(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    use crate::dead_letter::ReinjectError;
    let n: i64 = id.parse().map_err(|_| no_dead_letter(&id))?;
    match crate::dead_letter::reinject(&state.pool, &state.config, n).await {
        Ok(sent) => {
            let detail = json!({ "sent": sent });
            audited(&state.pool, &caller, "reinject_dead_letter", Some(&id), detail).await;
            Ok((StatusCode::ACCEPTED, axum::Json(sent)).into_response())
        }
        Err(ReinjectError::NotFound(_)) => Err(no_dead_letter(&id)),
        Err(e @ (ReinjectError::NotIntake { .. } | ReinjectError::NoValue(_))) => {
            Err(ApiError::new(StatusCode::CONFLICT, "not_reinjectable", e.to_string()))
        }
        Err(ReinjectError::Database(e)) => Err(e.into()),
        Err(e @ ReinjectError::Kafka(_)) => {
            Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e.to_string()))
        }
    }
}

async fn metrics() -> Result<String, ApiError> {
    jobfold_common::telemetry::render_metrics().ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "no metrics recorder in this process")
    })
}

async fn replay(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    use crate::store::ReplayError;
    let job_id = Uuid::parse_str(&id).map_err(|_| not_found(&id))?;
    let mut request: crate::store::Replay = optional_body(&body)?;
    request.requested_by = caller.requested_by(request.requested_by.take());
    let mut tx = state.pool.begin().await?;
    let replayed =
        crate::store::replay(&mut tx, &state.events, &state.policy, job_id, request).await;
    let job = match replayed {
        Ok(job) => job,
        Err(ReplayError::NotFound(_)) => return Err(not_found(&id)),
        Err(e @ ReplayError::NotQuarantined { .. }) => {
            return Err(ApiError::new(StatusCode::CONFLICT, "not_quarantined", e.to_string()));
        }
        Err(e @ (ReplayError::StaleVersion { .. } | ReplayError::InputWithoutVersion)) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                e.to_string(),
            ));
        }
        Err(ReplayError::Database(e)) => return Err(e.into()),
        Err(ReplayError::Other(e)) => {
            tracing::error!(error = %e, "Replay failed.");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "replay failed",
            ));
        }
    };
    let detail = json!({ "input_version": job.input_version, "request": said(&body) });
    let target = job_id.to_string();
    audit::record(&mut *tx, &caller.actor(), "replay", Some(&target), detail).await?;
    tx.commit().await?;
    crate::internal_events::JobsReplayed { count: 1, how: "one" }.emit();
    let body =
        json!({ "job_id": job.job_id, "state": "queued", "input_version": job.input_version });
    Ok((StatusCode::ACCEPTED, axum::Json(body)).into_response())
}

/// `POST /v1/auth`: who the token names (the access check refused a wrong one already).
async fn auth(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
) -> axum::Json<serde_json::Value> {
    axum::Json(json!({
        "name": caller.principal.name,
        "role": caller.principal.role,
        "token_required": state.access.tokens_required(),
    }))
}

async fn audit(
    State(state): State<ApiState>,
    filter: Result<Query<audit::AuditFilter>, QueryRejection>,
) -> Result<axum::Json<audit::AuditPage>, ApiError> {
    let Query(filter) = filter.map_err(bad_query)?;
    Ok(axum::Json(audit::list(&state.pool, &filter).await?))
}

/// A request's body as the audit trail keeps it: its JSON, or `null`.
fn said(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap_or(serde_json::Value::Null)
}

/// Records a change already committed (a bulk change, a kind's pause, a dead letter's):
/// should the record fail, the change stays made and the failure is logged and counted.
async fn audited(
    pool: &PgPool,
    caller: &Caller,
    action: &str,
    target: Option<&str>,
    detail: serde_json::Value,
) {
    if let Err(e) = audit::record(pool, &caller.actor(), action, target, detail).await {
        metrics::counter!(crate::metrics::AUDIT_FAILED_TOTAL).increment(1);
        tracing::error!(error = %e, action, target, actor = %caller.principal.name, request_id = %caller.request_id, "A change was made but its audit row could not be written.");
    }
}

async fn ready(State(state): State<ApiState>) -> Result<&'static str, ApiError> {
    sqlx::query_scalar!("SELECT 1 AS one").fetch_one(&state.pool).await?;
    Ok("ready")
}

#[cfg(test)]
mod tests {
    use super::{cross_origin, is_json_media_type};
    use axum::http::HeaderMap;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (k.parse().unwrap(), v.parse().unwrap())).collect()
    }

    #[test]
    fn only_requests_from_this_origin_or_from_no_browser_pass() {
        // curl, the CLI, other services: no Origin.
        assert_eq!(cross_origin(&headers(&[("host", "127.0.0.1:8080")])), None);
        let same = [("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")];
        assert_eq!(cross_origin(&headers(&same)), None);
        let other_port = [("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:9000")];
        assert_eq!(cross_origin(&headers(&other_port)).as_deref(), Some("http://127.0.0.1:9000"));
        let other_site = [("host", "jobs.internal"), ("origin", "https://evil.example")];
        assert!(cross_origin(&headers(&other_site)).is_some());
        assert!(cross_origin(&headers(&[("host", "a"), ("origin", "null")])).is_some());
        let fetch_metadata = [("host", "a"), ("sec-fetch-site", "cross-site")];
        assert!(cross_origin(&headers(&fetch_metadata)).is_some());
    }

    #[test]
    fn only_application_json_is_json() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("application/json; charset=utf-8"));
        assert!(is_json_media_type("Application/JSON"));
        assert!(!is_json_media_type("application/jsonx"));
        assert!(!is_json_media_type("application/json-patch+json"));
        assert!(!is_json_media_type("text/json"));
    }
}
