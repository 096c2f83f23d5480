//! A **stand-in** for a Confluent-compatible schema registry, for development and tests.
//!
//! Users run a real registry (Confluent Schema Registry, or Apicurio Registry's
//! `/apis/ccompat/v7` API; `docker/compose.yaml` starts Apicurio). On machines where no real
//! registry can be installed, `docker/registry.sh` starts this server instead, and says so.
//!
//! It implements the subset of the Confluent REST API that `schema_registry_converter` and the
//! operators' tools call, with the registry's own semantics:
//!
//! - `POST /subjects/{subject}/versions`: register; the same schema under the same subject
//!   returns the existing id; an incompatible schema is refused with 409.
//! - `POST /subjects/{subject}`: look a schema up under a subject (404 `40403` if absent).
//! - `GET /schemas/ids/{id}`, `GET /schemas/ids/{id}/versions`.
//! - `GET /subjects`, `GET /subjects/{subject}/versions`,
//!   `GET /subjects/{subject}/versions/{version|latest}[/schema]`.
//! - `POST /compatibility/subjects/{subject}/versions[/{version|latest}]`.
//! - `GET|PUT /config[/{subject}]`: compatibility level, default `BACKWARD`.
//!
//! Every route is served at the root and under `/apis/ccompat/v7`, where Apicurio Registry
//! serves its Confluent API, so `JOBFOLD_SCHEMA_REGISTRY_URL` is the same against both.
//!
//! Only Avro schemas are accepted (`schemaType` absent or `AVRO`). Compatibility is decided
//! by apache-avro's schema resolution rules. Ids are global and stable; with a state file the
//! registry survives restarts, so messages already on Kafka stay decodable.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use apache_avro::Schema;
use apache_avro::schema_compatibility::SchemaCompatibility;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Mutex;

/// Where Apicurio Registry serves its Confluent-compatible API; served here too.
pub const CCOMPAT_PREFIX: &str = "/apis/ccompat/v7";

const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// How a new version of a subject must relate to the earlier ones (Confluent's levels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Compatibility {
    None,
    Backward,
    BackwardTransitive,
    Forward,
    ForwardTransitive,
    Full,
    FullTransitive,
}

impl Compatibility {
    /// Is `new` compatible with the `existing` versions of a subject (oldest first)?
    fn accepts(self, existing: &[&Schema], new: &Schema) -> bool {
        let against: &[&Schema] = match self {
            Self::None => return true,
            Self::Backward | Self::Forward | Self::Full => {
                existing.last().map(std::slice::from_ref).unwrap_or_default()
            }
            Self::BackwardTransitive | Self::ForwardTransitive | Self::FullTransitive => existing,
        };
        against.iter().all(|old| {
            // BACKWARD: readers on the new schema read data written with the old one.
            let backward = || SchemaCompatibility::can_read(old, new).is_ok();
            let forward = || SchemaCompatibility::can_read(new, old).is_ok();
            match self {
                Self::None => true,
                Self::Backward | Self::BackwardTransitive => backward(),
                Self::Forward | Self::ForwardTransitive => forward(),
                Self::Full | Self::FullTransitive => backward() && forward(),
            }
        })
    }
}

/// What is persisted: every schema by id, every subject's versions, the levels.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Store {
    /// Schema text by id; id `n` is at index `n - 1`.
    schemas: Vec<String>,
    /// Schema ids of each subject's versions; version `v` is at index `v - 1`.
    subjects: BTreeMap<String, Vec<u32>>,
    global: Option<Compatibility>,
    levels: BTreeMap<String, Compatibility>,
}

impl Store {
    fn level(&self, subject: &str) -> Compatibility {
        self.levels.get(subject).copied().or(self.global).unwrap_or(Compatibility::Backward)
    }

    fn schema(&self, id: u32) -> Option<&str> {
        let index = usize::try_from(id).ok()?.checked_sub(1)?;
        self.schemas.get(index).map(String::as_str)
    }

    /// The id of a schema equal to `normalized`, if one was registered.
    fn find(&self, normalized: &str) -> Option<u32> {
        self.schemas
            .iter()
            .position(|s| normalize(s).is_ok_and(|n| n == normalized))
            .map(|i| u32::try_from(i + 1).expect("fewer than 2^32 schemas"))
    }

    /// `(version, id)` of `version` ("latest" or a number) of `subject`.
    fn version(&self, subject: &str, version: &str) -> Result<(u32, u32), ApiError> {
        let ids = self.subjects.get(subject).ok_or_else(|| ApiError::subject(subject))?;
        let index = if version == "latest" {
            ids.len().checked_sub(1)
        } else {
            version.parse::<usize>().ok().and_then(|v| v.checked_sub(1))
        };
        let index = index.filter(|&i| i < ids.len()).ok_or(ApiError {
            status: StatusCode::NOT_FOUND,
            code: 40402,
            message: format!("Version {version} not found."),
        })?;
        Ok((u32::try_from(index + 1).expect("few versions"), ids[index]))
    }
}

/// The registry: the store behind one lock, and where to persist it.
#[derive(Debug, Clone)]
pub struct Registry {
    store: Arc<Mutex<Store>>,
    state_file: Option<PathBuf>,
}

impl Registry {
    /// A registry kept in memory only.
    pub fn in_memory() -> Self {
        Self { store: Arc::default(), state_file: None }
    }

    /// A registry persisted to `path` after every change, loaded from it if it exists.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn persistent(path: PathBuf) -> anyhow::Result<Self> {
        let store = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Store::default(),
            Err(e) => return Err(e.into()),
        };
        Ok(Self { store: Arc::new(Mutex::new(store)), state_file: Some(path) })
    }

    /// The HTTP routes of the Confluent API subset described in the module docs, served at
    /// the root and under [`CCOMPAT_PREFIX`], like Apicurio's, so one URL fits both.
    pub fn router(self) -> Router {
        let api = Self::api(self);
        Router::new().nest(CCOMPAT_PREFIX, api.clone()).merge(api)
    }

    fn api(self) -> Router {
        Router::new()
            .route("/", get(|| async { Json(json!({})) }))
            .route("/subjects", get(list_subjects))
            .route("/subjects/{subject}", post(lookup))
            .route("/subjects/{subject}/versions", get(list_versions).post(register))
            .route("/subjects/{subject}/versions/{version}", get(get_version))
            .route("/subjects/{subject}/versions/{version}/schema", get(get_version_schema))
            .route("/schemas/ids/{id}", get(get_by_id))
            .route("/schemas/ids/{id}/versions", get(get_id_versions))
            .route("/compatibility/subjects/{subject}/versions", post(check_all))
            .route("/compatibility/subjects/{subject}/versions/{version}", post(check_version))
            .route("/config", get(get_global_config).put(put_global_config))
            .route("/config/{subject}", get(get_subject_config).put(put_subject_config))
            .with_state(self)
    }

    async fn persist(&self, store: &Store) -> Result<(), ApiError> {
        let Some(path) = &self.state_file else { return Ok(()) };
        let bytes = serde_json::to_vec_pretty(store).map_err(ApiError::internal)?;
        // Write then rename: a crash leaves the old file or the new one, never half of one.
        let tmp = path.with_extension("tmp");
        tokio::fs::write(&tmp, bytes).await.map_err(ApiError::internal)?;
        tokio::fs::rename(&tmp, path).await.map_err(ApiError::internal)
    }
}

/// JSON with the registry's content type.
struct Json(Value);

impl IntoResponse for Json {
    fn into_response(self) -> Response {
        ([(header::CONTENT_TYPE, CONTENT_TYPE)], self.0.to_string()).into_response()
    }
}

/// A Confluent-style error: `{"error_code": 40401, "message": "..."}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: u32,
    message: String,
}

impl ApiError {
    fn subject(subject: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            code: 40401,
            message: format!("Subject '{subject}' not found."),
        }
    }

    fn schema_not_found() -> Self {
        Self { status: StatusCode::NOT_FOUND, code: 40403, message: "Schema not found".into() }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self { status: StatusCode::UNPROCESSABLE_ENTITY, code: 42201, message: message.into() }
    }

    fn internal(e: impl std::fmt::Display) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, code: 50001, message: e.to_string() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error_code": self.code, "message": self.message });
        (self.status, Json(body)).into_response()
    }
}

/// The body of register, lookup and compatibility requests.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaRequest {
    schema: String,
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Value>,
}

impl SchemaRequest {
    fn parse(body: &Bytes) -> Result<(Self, Schema), ApiError> {
        let request: Self = serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("Invalid request body: {e}")))?;
        if let Some(kind) = request.schema_type.as_deref().filter(|k| *k != "AVRO") {
            return Err(ApiError::invalid(format!(
                "Schema type {kind} is not supported by this stand-in registry (AVRO only)."
            )));
        }
        if !request.references.is_empty() {
            return Err(ApiError::invalid("Schema references are not supported by this stand-in."));
        }
        let schema = Schema::parse_str(&request.schema)
            .map_err(|e| ApiError::invalid(format!("Invalid schema: {e}")))?;
        Ok((request, schema))
    }
}

/// Schema text with insignificant whitespace removed, the identity of a registered schema.
fn normalize(schema: &str) -> Result<String, serde_json::Error> {
    serde_json::from_str::<Value>(schema).map(|v| v.to_string())
}

fn parse_all<'a>(store: &'a Store, ids: &[u32]) -> Result<Vec<Schema>, ApiError> {
    ids.iter()
        .map(|&id| {
            let text: &'a str = store.schema(id).ok_or_else(ApiError::schema_not_found)?;
            Schema::parse_str(text).map_err(ApiError::internal)
        })
        .collect()
}

async fn register(
    State(registry): State<Registry>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Result<Json, ApiError> {
    let (request, schema) = SchemaRequest::parse(&body)?;
    let normalized = normalize(&request.schema).map_err(|e| ApiError::invalid(e.to_string()))?;
    let mut store = registry.store.lock().await;
    let versions = store.subjects.get(&subject).cloned().unwrap_or_default();
    if let Some(id) = store.find(&normalized).filter(|id| versions.contains(id)) {
        return Ok(Json(json!({ "id": id })));
    }
    let existing = parse_all(&store, &versions)?;
    let existing: Vec<&Schema> = existing.iter().collect();
    let level = store.level(&subject);
    if !level.accepts(&existing, &schema) {
        return Err(ApiError {
            status: StatusCode::CONFLICT,
            code: 409,
            message: format!(
                "Schema being registered is incompatible with an earlier schema for subject \
                 \"{subject}\" (compatibility {level:?})."
            ),
        });
    }
    let id = match store.find(&normalized) {
        Some(id) => id,
        None => {
            store.schemas.push(request.schema);
            u32::try_from(store.schemas.len()).expect("fewer than 2^32 schemas")
        }
    };
    store.subjects.entry(subject).or_default().push(id);
    registry.persist(&store).await?;
    Ok(Json(json!({ "id": id })))
}

async fn lookup(
    State(registry): State<Registry>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Result<Json, ApiError> {
    let (request, _) = SchemaRequest::parse(&body)?;
    let normalized = normalize(&request.schema).map_err(|e| ApiError::invalid(e.to_string()))?;
    let store = registry.store.lock().await;
    let ids = store.subjects.get(&subject).ok_or_else(|| ApiError::subject(&subject))?;
    let id = store.find(&normalized).ok_or_else(ApiError::schema_not_found)?;
    let index = ids.iter().position(|&v| v == id).ok_or_else(ApiError::schema_not_found)?;
    Ok(Json(json!({
        "subject": subject,
        "version": index + 1,
        "id": id,
        "schema": request.schema,
    })))
}

async fn list_subjects(State(registry): State<Registry>) -> Json {
    let store = registry.store.lock().await;
    Json(json!(store.subjects.keys().collect::<Vec<_>>()))
}

async fn list_versions(
    State(registry): State<Registry>,
    Path(subject): Path<String>,
) -> Result<Json, ApiError> {
    let store = registry.store.lock().await;
    let ids = store.subjects.get(&subject).ok_or_else(|| ApiError::subject(&subject))?;
    Ok(Json(json!((1..=ids.len()).collect::<Vec<_>>())))
}

async fn get_version(
    State(registry): State<Registry>,
    Path((subject, version)): Path<(String, String)>,
) -> Result<Json, ApiError> {
    let store = registry.store.lock().await;
    let (version, id) = store.version(&subject, &version)?;
    let schema = store.schema(id).ok_or_else(ApiError::schema_not_found)?;
    Ok(Json(json!({ "subject": subject, "version": version, "id": id, "schema": schema })))
}

async fn get_version_schema(
    State(registry): State<Registry>,
    Path((subject, version)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let store = registry.store.lock().await;
    let (_, id) = store.version(&subject, &version)?;
    let schema = store.schema(id).ok_or_else(ApiError::schema_not_found)?;
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], schema.to_owned()).into_response())
}

async fn get_by_id(
    State(registry): State<Registry>,
    Path(id): Path<u32>,
) -> Result<Json, ApiError> {
    let store = registry.store.lock().await;
    let schema = store.schema(id).ok_or_else(ApiError::schema_not_found)?;
    Ok(Json(json!({ "schema": schema })))
}

async fn get_id_versions(
    State(registry): State<Registry>,
    Path(id): Path<u32>,
) -> Result<Json, ApiError> {
    let store = registry.store.lock().await;
    store.schema(id).ok_or_else(ApiError::schema_not_found)?;
    let found: Vec<Value> = store
        .subjects
        .iter()
        .flat_map(|(subject, ids)| {
            ids.iter()
                .enumerate()
                .filter(move |(_, v)| **v == id)
                .map(move |(i, _)| json!({ "subject": subject, "version": i + 1 }))
        })
        .collect();
    Ok(Json(json!(found)))
}

async fn check(
    registry: &Registry,
    subject: &str,
    version: Option<&str>,
    body: &Bytes,
) -> Result<Json, ApiError> {
    let (_, schema) = SchemaRequest::parse(body)?;
    let store = registry.store.lock().await;
    let level = store.level(subject);
    let is_compatible = match version {
        Some(version) => {
            let (_, id) = store.version(subject, version)?;
            let old = parse_all(&store, &[id])?;
            // Against one named version, the level's direction applies to that version alone.
            let single = match level {
                Compatibility::BackwardTransitive => Compatibility::Backward,
                Compatibility::ForwardTransitive => Compatibility::Forward,
                Compatibility::FullTransitive => Compatibility::Full,
                other => other,
            };
            single.accepts(&[&old[0]], &schema)
        }
        None => {
            let ids = store.subjects.get(subject).cloned().unwrap_or_default();
            let old = parse_all(&store, &ids)?;
            level.accepts(&old.iter().collect::<Vec<_>>(), &schema)
        }
    };
    Ok(Json(json!({ "is_compatible": is_compatible })))
}

async fn check_all(
    State(registry): State<Registry>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Result<Json, ApiError> {
    check(&registry, &subject, None, &body).await
}

async fn check_version(
    State(registry): State<Registry>,
    Path((subject, version)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json, ApiError> {
    check(&registry, &subject, Some(&version), &body).await
}

#[derive(Debug, Deserialize)]
struct ConfigRequest {
    compatibility: Compatibility,
}

fn parse_config(body: &Bytes) -> Result<Compatibility, ApiError> {
    serde_json::from_slice::<ConfigRequest>(body).map(|c| c.compatibility).map_err(|e| ApiError {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        code: 42203,
        message: format!("Invalid compatibility level: {e}"),
    })
}

async fn get_global_config(State(registry): State<Registry>) -> Json {
    let store = registry.store.lock().await;
    let level = store.global.unwrap_or(Compatibility::Backward);
    Json(json!({ "compatibilityLevel": level }))
}

async fn put_global_config(
    State(registry): State<Registry>,
    body: Bytes,
) -> Result<Json, ApiError> {
    let level = parse_config(&body)?;
    let mut store = registry.store.lock().await;
    store.global = Some(level);
    registry.persist(&store).await?;
    Ok(Json(json!({ "compatibility": level })))
}

async fn get_subject_config(State(registry): State<Registry>, Path(subject): Path<String>) -> Json {
    let store = registry.store.lock().await;
    Json(json!({ "compatibilityLevel": store.level(&subject) }))
}

async fn put_subject_config(
    State(registry): State<Registry>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Result<Json, ApiError> {
    let level = parse_config(&body)?;
    let mut store = registry.store.lock().await;
    store.levels.insert(subject, level);
    registry.persist(&store).await?;
    Ok(Json(json!({ "compatibility": level })))
}
