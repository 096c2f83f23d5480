//! Rust types mirroring `job_event.avsc` and `job_request.avsc`, and their conversion to and
//! from apache-avro [`Value`]s.
//!
//! The conversion is written out by hand rather than derived: every field name and union
//! branch is checked against the schema when a value is read, so a drift between the `.avsc`
//! files and these types fails the round-trip tests instead of silently dropping data.

use std::fmt;
use std::sync::LazyLock;

use apache_avro::Schema;
use apache_avro::types::Value;
use chrono::{DateTime, TimeZone, Utc};
use uuid::Uuid;

// The handler API's types that events carry: one definition, shared with handlers.
pub use jobfold_handler::{ErrorClass, TRACEPARENT, TRACESTATE, TraceContext};

/// The `JobEvent` schema text, registered under `jobfold.job-events-value`.
pub const JOB_EVENT_SCHEMA_TEXT: &str = include_str!("../job_event.avsc");
/// The `JobRequest` schema text, registered under `jobfold.job-requests-value`.
pub const JOB_REQUEST_SCHEMA_TEXT: &str = include_str!("../job_request.avsc");

/// The parsed `JobEvent` schema: this build's reader and writer schema.
pub static JOB_EVENT_SCHEMA: LazyLock<Schema> = LazyLock::new(|| {
    Schema::parse_str(JOB_EVENT_SCHEMA_TEXT).expect("job_event.avsc is a valid Avro schema")
});
/// The parsed `JobRequest` schema.
pub static JOB_REQUEST_SCHEMA: LazyLock<Schema> = LazyLock::new(|| {
    Schema::parse_str(JOB_REQUEST_SCHEMA_TEXT).expect("job_request.avsc is a valid Avro schema")
});

/// One event of one job's stream: the unit of `job_events` and of `jobfold.job-events`.
#[derive(Debug, Clone, PartialEq)]
pub struct JobEvent {
    /// Unique per event; the consumers' dedupe key.
    pub event_id: Uuid,
    pub job_id: Uuid,
    /// The Kafka key.
    pub document_id: String,
    pub job_kind: String,
    pub input_version: i64,
    /// 1 for `JobRequested`, then gap-free per job.
    pub stream_version: i32,
    pub occurred_at: DateTime<Utc>,
    pub trace: Option<TraceContext>,
    /// Which component appended the event.
    pub producer: String,
    pub payload: Payload,
}

/// Kafka header carrying the event's kind ([`Payload::kind`]), so a consumer can pass over
/// the kinds it does not act on without decoding them.
pub const EVENT_KIND: &str = "jobfold-event";

/// What happened: the `payload` union, one variant per branch, in schema order.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    JobRequested(JobRequested),
    JobLeased(JobLeased),
    JobSucceeded(JobSucceeded),
    JobFailed(JobFailed),
    JobRetryScheduled(JobRetryScheduled),
    RetryDue(RetryDue),
    JobQuarantined(JobQuarantined),
    ReplayRequested(ReplayRequested),
    JobSuperseded(JobSuperseded),
    JobCancelled(JobCancelled),
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobRequested {
    /// The input as JSON text.
    pub input: String,
    pub idempotency_key: Option<String>,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
    /// A scheduled job: not dispatched before this instant.
    pub run_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobLeased {
    pub generation: i64,
    pub attempt: i32,
    pub lease_owner: String,
    pub lease_until: DateTime<Utc>,
    /// When the lease was taken and the attempt began; `None` in events written before the
    /// field was added. The event's `occurred_at` can be later: a run inside its lease
    /// transaction is recorded when that transaction commits.
    pub leased_at: Option<DateTime<Utc>>,
    pub dispatch_event_id: Uuid,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobSucceeded {
    pub generation: i64,
    pub attempt: i32,
    /// The result as JSON text.
    pub result: String,
    /// The lease this success took itself, when its run ended inside its lease transaction
    /// and no `JobLeased` was written: `generation` and `attempt` are then one above the
    /// job's before it. `None` when a `JobLeased` of this generation came before, and in
    /// events written before the field was added.
    pub lease: Option<LeaseTaken>,
}

/// A lease taken and ended by the same `JobSucceeded` ([`JobSucceeded::lease`]): what a
/// `JobLeased` would have said of it, less the expiry a finished attempt no longer has.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseTaken {
    pub lease_owner: String,
    /// When the lease was taken and the attempt began; the event's `occurred_at` is when its
    /// transaction committed.
    pub leased_at: DateTime<Utc>,
    pub dispatch_event_id: Uuid,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobFailed {
    pub generation: i64,
    pub attempt: i32,
    pub error_class: ErrorClass,
    pub message: String,
    /// Whether the attempt's side effects happened is unknown (it timed out or lost its
    /// connection after sending, panicked, lost its lease, died with its process): the next
    /// attempt is told so. `None` in events written before the field was added.
    pub outcome_unknown: Option<bool>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobRetryScheduled {
    pub attempt: i32,
    pub next_attempt_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RetryDue {
    pub due_at: DateTime<Utc>,
    pub reason: DispatchReason,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobQuarantined {
    pub reason: String,
    pub error_class: ErrorClass,
    pub owner: String,
    pub attempts: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReplayRequested {
    pub requested_by: String,
    pub new_input_version: Option<i64>,
    pub new_input: Option<String>,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobSuperseded {
    pub by_input_version: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JobCancelled {
    pub requested_by: String,
    pub reason: String,
}

/// Why a job is dispatched again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DispatchReason {
    Backoff,
    LeaseExpired,
    Stalled,
}

/// A request on the intake topic, `jobfold.job-requests`.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRequest {
    /// The intake's dedupe key.
    pub request_id: Uuid,
    pub document_id: String,
    pub job_kind: String,
    pub input_version: i64,
    /// The input as JSON text.
    pub input: String,
    pub requested_at: DateTime<Utc>,
    pub producer: String,
    pub trace: Option<TraceContext>,
    /// Not to be run before this instant (a scheduled job).
    pub run_at: Option<DateTime<Utc>>,
}

/// A decoded value does not have the shape this build's types expect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct ShapeError {
    /// Where in the record, e.g. `JobEvent.payload.JobLeased.attempt`.
    pub path: String,
    pub problem: String,
}

impl ShapeError {
    fn new(path: &str, problem: impl Into<String>) -> Self {
        Self { path: path.to_owned(), problem: problem.into() }
    }
}

impl Payload {
    /// The union branch's record name, as stored in `job_events.kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JobRequested(_) => "JobRequested",
            Self::JobLeased(_) => "JobLeased",
            Self::JobSucceeded(_) => "JobSucceeded",
            Self::JobFailed(_) => "JobFailed",
            Self::JobRetryScheduled(_) => "JobRetryScheduled",
            Self::RetryDue(_) => "RetryDue",
            Self::JobQuarantined(_) => "JobQuarantined",
            Self::ReplayRequested(_) => "ReplayRequested",
            Self::JobSuperseded(_) => "JobSuperseded",
            Self::JobCancelled(_) => "JobCancelled",
        }
    }

    /// Events that make a processor lease and run the job.
    pub fn is_dispatch(&self) -> bool {
        matches!(self, Self::JobRequested(_) | Self::RetryDue(_) | Self::ReplayRequested(_))
    }

    /// Whether an event of this kind (a [`Payload::kind`], as the [`EVENT_KIND`] header
    /// carries it) makes a processor lease and run the job. An unknown kind counts as one:
    /// the processor decodes it and decides.
    pub fn is_dispatch_kind(kind: &[u8]) -> bool {
        !matches!(
            kind,
            b"JobLeased"
                | b"JobSucceeded"
                | b"JobFailed"
                | b"JobRetryScheduled"
                | b"JobQuarantined"
                | b"JobSuperseded"
                | b"JobCancelled"
        )
    }
}

impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

impl DispatchReason {
    const SYMBOLS: [&'static str; 3] = ["BACKOFF", "LEASE_EXPIRED", "STALLED"];

    pub fn as_str(self) -> &'static str {
        Self::SYMBOLS[self as usize]
    }

    fn from_index(index: u32) -> Option<Self> {
        [Self::Backoff, Self::LeaseExpired, Self::Stalled].get(index as usize).copied()
    }
}

// ---------------------------------------------------------------------------------------
// Rust -> Avro

fn record(fields: Vec<(&str, Value)>) -> Value {
    Value::Record(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

fn millis(t: DateTime<Utc>) -> Value {
    Value::TimestampMillis(t.timestamp_millis())
}

/// `["null", T]` with T present or not.
fn nullable(value: Option<Value>) -> Value {
    match value {
        None => Value::Union(0, Box::new(Value::Null)),
        Some(v) => Value::Union(1, Box::new(v)),
    }
}

fn error_class(class: ErrorClass) -> Value {
    Value::Enum(class as u32, class.as_str().to_owned())
}

fn trace(t: Option<&TraceContext>) -> Value {
    nullable(t.map(|t| {
        record(vec![
            ("traceparent", Value::String(t.traceparent.clone())),
            ("tracestate", nullable(t.tracestate.clone().map(Value::String))),
        ])
    }))
}

impl From<&Payload> for Value {
    fn from(payload: &Payload) -> Self {
        let (index, body) = match payload {
            Payload::JobRequested(p) => (
                0,
                record(vec![
                    ("input", Value::String(p.input.clone())),
                    ("idempotency_key", nullable(p.idempotency_key.clone().map(Value::String))),
                    ("max_attempts", Value::Int(p.max_attempts)),
                    ("deadline", nullable(p.deadline.map(millis))),
                    ("run_at", nullable(p.run_at.map(millis))),
                ]),
            ),
            Payload::JobLeased(p) => (
                1,
                record(vec![
                    ("generation", Value::Long(p.generation)),
                    ("attempt", Value::Int(p.attempt)),
                    ("lease_owner", Value::String(p.lease_owner.clone())),
                    ("lease_until", millis(p.lease_until)),
                    ("leased_at", nullable(p.leased_at.map(millis))),
                    ("dispatch_event_id", Value::Uuid(p.dispatch_event_id)),
                ]),
            ),
            Payload::JobSucceeded(p) => (
                2,
                record(vec![
                    ("generation", Value::Long(p.generation)),
                    ("attempt", Value::Int(p.attempt)),
                    ("result", Value::String(p.result.clone())),
                    (
                        "lease",
                        nullable(p.lease.as_ref().map(|l| {
                            record(vec![
                                ("lease_owner", Value::String(l.lease_owner.clone())),
                                ("leased_at", millis(l.leased_at)),
                                ("dispatch_event_id", Value::Uuid(l.dispatch_event_id)),
                            ])
                        })),
                    ),
                ]),
            ),
            Payload::JobFailed(p) => (
                3,
                record(vec![
                    ("generation", Value::Long(p.generation)),
                    ("attempt", Value::Int(p.attempt)),
                    ("error_class", error_class(p.error_class)),
                    ("message", Value::String(p.message.clone())),
                    ("outcome_unknown", nullable(p.outcome_unknown.map(Value::Boolean))),
                ]),
            ),
            Payload::JobRetryScheduled(p) => (
                4,
                record(vec![
                    ("attempt", Value::Int(p.attempt)),
                    ("next_attempt_at", millis(p.next_attempt_at)),
                ]),
            ),
            Payload::RetryDue(p) => (
                5,
                record(vec![
                    ("due_at", millis(p.due_at)),
                    ("reason", Value::Enum(p.reason as u32, p.reason.as_str().to_owned())),
                ]),
            ),
            Payload::JobQuarantined(p) => (
                6,
                record(vec![
                    ("reason", Value::String(p.reason.clone())),
                    ("error_class", error_class(p.error_class)),
                    ("owner", Value::String(p.owner.clone())),
                    ("attempts", Value::Int(p.attempts)),
                ]),
            ),
            Payload::ReplayRequested(p) => (
                7,
                record(vec![
                    ("requested_by", Value::String(p.requested_by.clone())),
                    ("new_input_version", nullable(p.new_input_version.map(Value::Long))),
                    ("new_input", nullable(p.new_input.clone().map(Value::String))),
                    ("max_attempts", Value::Int(p.max_attempts)),
                    ("deadline", nullable(p.deadline.map(millis))),
                ]),
            ),
            Payload::JobSuperseded(p) => {
                (8, record(vec![("by_input_version", Value::Long(p.by_input_version))]))
            }
            Payload::JobCancelled(p) => (
                9,
                record(vec![
                    ("requested_by", Value::String(p.requested_by.clone())),
                    ("reason", Value::String(p.reason.clone())),
                ]),
            ),
        };
        Value::Union(index, Box::new(body))
    }
}

impl From<&JobEvent> for Value {
    fn from(e: &JobEvent) -> Self {
        record(vec![
            ("event_id", Value::Uuid(e.event_id)),
            ("job_id", Value::Uuid(e.job_id)),
            ("document_id", Value::String(e.document_id.clone())),
            ("job_kind", Value::String(e.job_kind.clone())),
            ("input_version", Value::Long(e.input_version)),
            ("stream_version", Value::Int(e.stream_version)),
            ("occurred_at", millis(e.occurred_at)),
            ("trace", trace(e.trace.as_ref())),
            ("producer", Value::String(e.producer.clone())),
            ("payload", Value::from(&e.payload)),
        ])
    }
}

impl JobEvent {
    /// The event as JSON, for people and analytics: the schema's field names, times as
    /// RFC 3339 strings, the payload as an object whose `type` names its branch. String
    /// fields holding JSON (`input`, `result`) stay strings, exactly as in the event.
    pub fn to_json(&self) -> serde_json::Value {
        let mut json = avro_to_json(Value::from(self));
        if let Some(payload) = json.get_mut("payload").and_then(serde_json::Value::as_object_mut) {
            payload.insert("type".into(), self.payload.kind().into());
        }
        json
    }
}

/// An Avro value of jobfold's schemas as plain JSON.
fn avro_to_json(value: Value) -> serde_json::Value {
    use serde_json::Value as Json;
    match value {
        Value::Null => Json::Null,
        Value::Boolean(b) => b.into(),
        Value::Int(i) => i.into(),
        Value::Long(l) => l.into(),
        Value::Float(f) => f.into(),
        Value::Double(d) => d.into(),
        Value::String(s) | Value::Enum(_, s) => s.into(),
        Value::Uuid(u) => u.to_string().into(),
        Value::TimestampMillis(ms) => DateTime::from_timestamp_millis(ms)
            .map_or(Json::Null, |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true).into()),
        Value::Union(_, inner) => avro_to_json(*inner),
        Value::Record(fields) => {
            Json::Object(fields.into_iter().map(|(k, v)| (k, avro_to_json(v))).collect())
        }
        Value::Array(items) => Json::Array(items.into_iter().map(avro_to_json).collect()),
        other => Json::String(format!("{other:?}")),
    }
}

impl From<&JobRequest> for Value {
    fn from(r: &JobRequest) -> Self {
        record(vec![
            ("request_id", Value::Uuid(r.request_id)),
            ("document_id", Value::String(r.document_id.clone())),
            ("job_kind", Value::String(r.job_kind.clone())),
            ("input_version", Value::Long(r.input_version)),
            ("input", Value::String(r.input.clone())),
            ("requested_at", millis(r.requested_at)),
            ("producer", Value::String(r.producer.clone())),
            ("trace", trace(r.trace.as_ref())),
            ("run_at", nullable(r.run_at.map(millis))),
        ])
    }
}

// ---------------------------------------------------------------------------------------
// Avro -> Rust

/// The fields of one decoded record, taken out by name.
struct Fields {
    path: String,
    fields: Vec<(String, Value)>,
}

impl Fields {
    fn of(path: &str, value: Value) -> Result<Self, ShapeError> {
        match value {
            Value::Record(fields) => Ok(Self { path: path.to_owned(), fields }),
            other => Err(ShapeError::new(path, format!("expected a record, found {other:?}"))),
        }
    }

    fn take(&mut self, name: &str) -> Result<(String, Value), ShapeError> {
        let path = format!("{}.{name}", self.path);
        let index = self
            .fields
            .iter()
            .position(|(k, _)| k == name)
            .ok_or_else(|| ShapeError::new(&path, "missing field"))?;
        let (_, value) = self.fields.swap_remove(index);
        Ok((path, value))
    }

    fn string(&mut self, name: &str) -> Result<String, ShapeError> {
        let (path, value) = self.take(name)?;
        as_string(&path, value)
    }

    fn long(&mut self, name: &str) -> Result<i64, ShapeError> {
        match self.take(name)? {
            (_, Value::Long(v)) => Ok(v),
            (path, other) => Err(unexpected(&path, "a long", &other)),
        }
    }

    fn int(&mut self, name: &str) -> Result<i32, ShapeError> {
        match self.take(name)? {
            (_, Value::Int(v)) => Ok(v),
            (path, other) => Err(unexpected(&path, "an int", &other)),
        }
    }

    fn uuid(&mut self, name: &str) -> Result<Uuid, ShapeError> {
        match self.take(name)? {
            (_, Value::Uuid(v)) => Ok(v),
            (path, Value::String(s)) => {
                Uuid::parse_str(&s).map_err(|e| ShapeError::new(&path, format!("not a UUID: {e}")))
            }
            (path, other) => Err(unexpected(&path, "a uuid", &other)),
        }
    }

    fn timestamp(&mut self, name: &str) -> Result<DateTime<Utc>, ShapeError> {
        let (path, value) = self.take(name)?;
        as_timestamp(&path, value)
    }

    /// A `["null", T]` field, converted with `convert` when present.
    fn nullable<T>(
        &mut self,
        name: &str,
        convert: impl FnOnce(&str, Value) -> Result<T, ShapeError>,
    ) -> Result<Option<T>, ShapeError> {
        match self.take(name)? {
            (_, Value::Null) => Ok(None),
            (_, Value::Union(_, inner)) if *inner == Value::Null => Ok(None),
            (path, Value::Union(_, inner)) => convert(&path, *inner).map(Some),
            (path, other) => convert(&path, other).map(Some),
        }
    }

    fn enum_index(&mut self, name: &str) -> Result<(String, u32, String), ShapeError> {
        match self.take(name)? {
            (path, Value::Enum(index, symbol)) => Ok((path, index, symbol)),
            (path, other) => Err(unexpected(&path, "an enum", &other)),
        }
    }

    fn error_class(&mut self, name: &str) -> Result<ErrorClass, ShapeError> {
        let (path, index, symbol) = self.enum_index(name)?;
        ErrorClass::ALL
            .get(index as usize)
            .copied()
            .filter(|c| c.as_str() == symbol)
            .ok_or_else(|| ShapeError::new(&path, format!("unknown error class {symbol}")))
    }

    fn dispatch_reason(&mut self, name: &str) -> Result<DispatchReason, ShapeError> {
        let (path, index, symbol) = self.enum_index(name)?;
        DispatchReason::from_index(index)
            .filter(|c| c.as_str() == symbol)
            .ok_or_else(|| ShapeError::new(&path, format!("unknown dispatch reason {symbol}")))
    }

    fn trace(&mut self) -> Result<Option<TraceContext>, ShapeError> {
        self.nullable("trace", |path, value| {
            let mut f = Fields::of(path, value)?;
            Ok(TraceContext {
                traceparent: f.string("traceparent")?,
                tracestate: f.nullable("tracestate", as_string)?,
            })
        })
    }
}

fn unexpected(path: &str, expected: &str, found: &Value) -> ShapeError {
    ShapeError::new(path, format!("expected {expected}, found {found:?}"))
}

fn as_string(path: &str, value: Value) -> Result<String, ShapeError> {
    match value {
        Value::String(s) => Ok(s),
        other => Err(unexpected(path, "a string", &other)),
    }
}

fn as_timestamp(path: &str, value: Value) -> Result<DateTime<Utc>, ShapeError> {
    match value {
        Value::TimestampMillis(ms) | Value::Long(ms) => Utc
            .timestamp_millis_opt(ms)
            .single()
            .ok_or_else(|| ShapeError::new(path, format!("timestamp {ms} ms is out of range"))),
        other => Err(unexpected(path, "a timestamp-millis", &other)),
    }
}

fn as_bool(path: &str, value: Value) -> Result<bool, ShapeError> {
    match value {
        Value::Boolean(v) => Ok(v),
        other => Err(unexpected(path, "a boolean", &other)),
    }
}

fn as_long(path: &str, value: Value) -> Result<i64, ShapeError> {
    match value {
        Value::Long(v) => Ok(v),
        other => Err(unexpected(path, "a long", &other)),
    }
}

impl Payload {
    fn from_value(path: &str, value: Value) -> Result<Self, ShapeError> {
        let (index, inner) = match value {
            Value::Union(index, inner) => (index, *inner),
            other => return Err(unexpected(path, "a union", &other)),
        };
        let branch = match index {
            0 => "JobRequested",
            1 => "JobLeased",
            2 => "JobSucceeded",
            3 => "JobFailed",
            4 => "JobRetryScheduled",
            5 => "RetryDue",
            6 => "JobQuarantined",
            7 => "ReplayRequested",
            8 => "JobSuperseded",
            9 => "JobCancelled",
            other => return Err(ShapeError::new(path, format!("unknown union branch {other}"))),
        };
        let mut f = Fields::of(&format!("{path}.{branch}"), inner)?;
        Ok(match index {
            0 => Self::JobRequested(JobRequested {
                input: f.string("input")?,
                idempotency_key: f.nullable("idempotency_key", as_string)?,
                max_attempts: f.int("max_attempts")?,
                deadline: f.nullable("deadline", as_timestamp)?,
                run_at: f.nullable("run_at", as_timestamp)?,
            }),
            1 => Self::JobLeased(JobLeased {
                generation: f.long("generation")?,
                attempt: f.int("attempt")?,
                lease_owner: f.string("lease_owner")?,
                lease_until: f.timestamp("lease_until")?,
                leased_at: f.nullable("leased_at", as_timestamp)?,
                dispatch_event_id: f.uuid("dispatch_event_id")?,
            }),
            2 => Self::JobSucceeded(JobSucceeded {
                generation: f.long("generation")?,
                attempt: f.int("attempt")?,
                result: f.string("result")?,
                lease: f.nullable("lease", |path, value| {
                    let mut f = Fields::of(path, value)?;
                    Ok(LeaseTaken {
                        lease_owner: f.string("lease_owner")?,
                        leased_at: f.timestamp("leased_at")?,
                        dispatch_event_id: f.uuid("dispatch_event_id")?,
                    })
                })?,
            }),
            3 => Self::JobFailed(JobFailed {
                generation: f.long("generation")?,
                attempt: f.int("attempt")?,
                error_class: f.error_class("error_class")?,
                message: f.string("message")?,
                outcome_unknown: f.nullable("outcome_unknown", as_bool)?,
            }),
            4 => Self::JobRetryScheduled(JobRetryScheduled {
                attempt: f.int("attempt")?,
                next_attempt_at: f.timestamp("next_attempt_at")?,
            }),
            5 => Self::RetryDue(RetryDue {
                due_at: f.timestamp("due_at")?,
                reason: f.dispatch_reason("reason")?,
            }),
            6 => Self::JobQuarantined(JobQuarantined {
                reason: f.string("reason")?,
                error_class: f.error_class("error_class")?,
                owner: f.string("owner")?,
                attempts: f.int("attempts")?,
            }),
            7 => Self::ReplayRequested(ReplayRequested {
                requested_by: f.string("requested_by")?,
                new_input_version: f.nullable("new_input_version", as_long)?,
                new_input: f.nullable("new_input", as_string)?,
                max_attempts: f.int("max_attempts")?,
                deadline: f.nullable("deadline", as_timestamp)?,
            }),
            8 => {
                Self::JobSuperseded(JobSuperseded { by_input_version: f.long("by_input_version")? })
            }
            _ => Self::JobCancelled(JobCancelled {
                requested_by: f.string("requested_by")?,
                reason: f.string("reason")?,
            }),
        })
    }
}

impl TryFrom<Value> for JobEvent {
    type Error = ShapeError;

    /// Reads a value already resolved to this build's `JobEvent` schema.
    fn try_from(value: Value) -> Result<Self, ShapeError> {
        let mut f = Fields::of("JobEvent", value)?;
        Ok(Self {
            event_id: f.uuid("event_id")?,
            job_id: f.uuid("job_id")?,
            document_id: f.string("document_id")?,
            job_kind: f.string("job_kind")?,
            input_version: f.long("input_version")?,
            stream_version: f.int("stream_version")?,
            occurred_at: f.timestamp("occurred_at")?,
            trace: f.trace()?,
            producer: f.string("producer")?,
            payload: {
                let (path, value) = f.take("payload")?;
                Payload::from_value(&path, value)?
            },
        })
    }
}

impl TryFrom<Value> for JobRequest {
    type Error = ShapeError;

    /// Reads a value already resolved to this build's `JobRequest` schema.
    fn try_from(value: Value) -> Result<Self, ShapeError> {
        let mut f = Fields::of("JobRequest", value)?;
        Ok(Self {
            request_id: f.uuid("request_id")?,
            document_id: f.string("document_id")?,
            job_kind: f.string("job_kind")?,
            input_version: f.long("input_version")?,
            input: f.string("input")?,
            requested_at: f.timestamp("requested_at")?,
            producer: f.string("producer")?,
            trace: f.trace()?,
            run_at: f.nullable("run_at", as_timestamp)?,
        })
    }
}
