//! The Confluent wire format: magic byte `0`, the writer schema's registry id (4 bytes, big
//! endian), the Avro binary body.
//!
//! [`Codec::connect`] registers this build's schema under the topic's value subject
//! (TopicNameStrategy: `<topic>-value`) through `schema_registry_converter`, and encodes with
//! the id it got. [`Codec::decode`] reads the writer schema id from each frame, fetches that
//! schema once (then caches it), and resolves the body to this build's reader schema, so
//! data written by any BACKWARD-compatible older writer decodes.
//!
//! Every decode failure is one [`DecodeError`] variant, marked retryable or not: a consumer
//! dead-letters what can never decode and retries only what may heal (the registry being
//! unreachable).

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::schema_compatibility::SchemaCompatibility;
use apache_avro::types::Value;
use apache_avro::writer::datum::GenericDatumWriter;
/// The registry client's settings and errors, for callers that build the settings.
pub use schema_registry_converter::async_impl::schema_registry::SrSettings;
use schema_registry_converter::async_impl::schema_registry::{
    get_all_subjects, get_schema_by_id, is_compatible_schema, post_schema,
};
pub use schema_registry_converter::error::SRCError;
use schema_registry_converter::schema_registry_common::{SchemaType, SuppliedSchema};

use crate::event::{
    JOB_EVENT_SCHEMA, JOB_EVENT_SCHEMA_TEXT, JOB_REQUEST_SCHEMA, JOB_REQUEST_SCHEMA_TEXT, JobEvent,
    JobRequest, ShapeError,
};

/// The Confluent wire format's magic byte.
pub const MAGIC_BYTE: u8 = 0;
/// Magic byte plus schema id.
pub const HEADER_LEN: usize = 5;

/// A type with an Avro schema of its own, carried in the Confluent wire format.
pub trait Record: Sized {
    /// This build's schema text, as registered.
    fn schema_text() -> &'static str;
    /// This build's parsed schema: the writer schema when encoding, the reader when decoding.
    fn schema() -> &'static Schema;
    fn to_value(&self) -> Value;
    /// # Errors
    /// The value, resolved to [`Record::schema`], does not fit the Rust type.
    fn from_value(value: Value) -> Result<Self, ShapeError>;
}

impl Record for JobEvent {
    fn schema_text() -> &'static str {
        JOB_EVENT_SCHEMA_TEXT
    }
    fn schema() -> &'static Schema {
        &JOB_EVENT_SCHEMA
    }
    fn to_value(&self) -> Value {
        Value::from(self)
    }
    fn from_value(value: Value) -> Result<Self, ShapeError> {
        Self::try_from(value)
    }
}

impl Record for JobRequest {
    fn schema_text() -> &'static str {
        JOB_REQUEST_SCHEMA_TEXT
    }
    fn schema() -> &'static Schema {
        &JOB_REQUEST_SCHEMA
    }
    fn to_value(&self) -> Value {
        Value::from(self)
    }
    fn from_value(value: Value) -> Result<Self, ShapeError> {
        Self::try_from(value)
    }
}

/// Why a frame did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than the 5-byte header.
    #[error("truncated frame: {len} bytes, the Confluent header alone needs {HEADER_LEN}")]
    Truncated { len: usize },
    /// The first byte is not the Confluent magic byte.
    #[error("bad magic byte {found:#04x}, expected {MAGIC_BYTE:#04x}: not Confluent wire format")]
    BadMagicByte { found: u8 },
    /// The registry does not know the writer schema id.
    #[error("schema id {id} is unknown to the schema registry")]
    UnknownSchemaId { id: u32 },
    /// The writer schema cannot be resolved to this build's reader schema.
    #[error("writer schema {id} cannot be read with the {reader} schema: {reason}")]
    IncompatibleSchema { id: u32, reader: String, reason: String },
    /// The body is not valid Avro for its writer schema, or does not fit the Rust type.
    #[error("body does not match writer schema {id}: {reason}")]
    BodyMismatch { id: u32, reason: String },
    /// The registry could not be asked for the writer schema; asking again may work.
    #[error("schema registry unreachable while fetching schema {id}: {reason}")]
    RegistryUnreachable { id: u32, reason: String },
}

impl DecodeError {
    /// Whether decoding the same bytes again may succeed. Only a registry outage heals; every
    /// other variant is poison and belongs in `dead_letters`.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::RegistryUnreachable { .. })
    }

    /// A short stable name for metrics labels and dead-letter rows.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::BadMagicByte { .. } => "bad_magic_byte",
            Self::UnknownSchemaId { .. } => "unknown_schema_id",
            Self::IncompatibleSchema { .. } => "incompatible_schema",
            Self::BodyMismatch { .. } => "body_mismatch",
            Self::RegistryUnreachable { .. } => "registry_unreachable",
        }
    }
}

/// Registering this build's schema failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("registering the schema under subject {subject}: {cause}")]
pub struct RegisterError {
    pub subject: String,
    #[source]
    pub cause: SRCError,
}

/// A value did not validate against this build's own schema: a bug, never bad input.
#[derive(Debug, thiserror::Error)]
#[error("encoding with this build's schema: {0}")]
pub struct EncodeError(#[source] pub Box<apache_avro::Error>);

/// Splits a Confluent frame into the writer schema id and the Avro body.
///
/// # Errors
/// [`DecodeError::Truncated`] or [`DecodeError::BadMagicByte`].
pub fn split_frame(frame: &[u8]) -> Result<(u32, &[u8]), DecodeError> {
    if frame.len() < HEADER_LEN {
        return Err(DecodeError::Truncated { len: frame.len() });
    }
    if frame[0] != MAGIC_BYTE {
        return Err(DecodeError::BadMagicByte { found: frame[0] });
    }
    let id = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]);
    Ok((id, &frame[HEADER_LEN..]))
}

/// Frames an Avro body with its writer schema id.
pub fn frame(id: u32, body: &[u8]) -> Vec<u8> {
    let mut framed = Vec::with_capacity(HEADER_LEN + body.len());
    framed.push(MAGIC_BYTE);
    framed.extend_from_slice(&id.to_be_bytes());
    framed.extend_from_slice(body);
    framed
}

/// Decodes an Avro body written with `writer` into `T`, resolving to `T`'s schema.
///
/// # Errors
/// [`DecodeError::BodyMismatch`] when the bytes are not `writer` Avro, bytes remain after the
/// record, or the value does not fit `T`.
pub fn decode_body<T: Record>(id: u32, writer: &Schema, body: &[u8]) -> Result<T, DecodeError> {
    let reader =
        GenericDatumReader::builder(writer).reader_schema(T::schema()).build().map_err(|e| {
            DecodeError::IncompatibleSchema {
                id,
                reader: "this build's".into(),
                reason: e.to_string(),
            }
        })?;
    read_body(id, &reader, body)
}

fn read_body<T: Record>(
    id: u32,
    reader: &GenericDatumReader<'_>,
    body: &[u8],
) -> Result<T, DecodeError> {
    let mismatch = |reason: String| DecodeError::BodyMismatch { id, reason };
    let mut rest = body;
    let value = reader.read_value(&mut rest).map_err(|e| mismatch(e.to_string()))?;
    if !rest.is_empty() {
        return Err(mismatch(format!("{} bytes left after the record", rest.len())));
    }
    T::from_value(value).map_err(|e| mismatch(e.to_string()))
}

/// Encodes `value` with `schema` (validated first) into an Avro body.
///
/// # Errors
/// [`EncodeError`] if the value does not validate against `schema`.
pub fn encode_body(schema: &Schema, value: Value) -> Result<Vec<u8>, EncodeError> {
    GenericDatumWriter::builder(schema)
        .build()
        .and_then(|w| w.write_value_to_vec(value))
        .map_err(|e| EncodeError(Box::new(e)))
}

/// A writer schema fetched from the registry, ready to read with.
///
/// Schemas are leaked to get `'static` readers that resolve the schema pair once, not per
/// message. That is bounded: one per distinct writer schema id met in the process's life.
enum WriterSchema {
    Readable(GenericDatumReader<'static>),
    /// It cannot be resolved to the reader schema; why.
    Unreadable(String),
}

/// Decodes `T` from Confluent frames, fetching writer schemas from the registry by the id in
/// each frame and caching them. Needs no registration: readers such as replay use it alone.
///
/// Cheap to clone; clones share the schema cache.
pub struct Decoder<T> {
    settings: SrSettings,
    writers: Arc<RwLock<HashMap<u32, Arc<WriterSchema>>>>,
    _record: PhantomData<fn() -> T>,
}

impl<T> Clone for Decoder<T> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            writers: Arc::clone(&self.writers),
            _record: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Decoder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cached = self.writers.read().map(|w| w.len()).unwrap_or_default();
        f.debug_struct("Decoder").field("cached_schemas", &cached).finish()
    }
}

impl<T: Record> Decoder<T> {
    /// A decoder asking the registry behind `settings`; no request is made until a frame
    /// carries an unknown schema id.
    pub fn new(settings: SrSettings) -> Self {
        Self { settings, writers: Arc::default(), _record: PhantomData }
    }

    /// Decodes a Confluent frame, fetching its writer schema from the registry if it is not
    /// cached yet.
    ///
    /// # Errors
    /// A [`DecodeError`]; see [`DecodeError::is_retryable`].
    pub async fn decode(&self, frame: &[u8]) -> Result<T, DecodeError> {
        let (id, body) = split_frame(frame)?;
        match &*self.writer(id).await? {
            WriterSchema::Readable(reader) => read_body(id, reader, body),
            WriterSchema::Unreadable(reason) => Err(DecodeError::IncompatibleSchema {
                id,
                reader: reader_name::<T>(),
                reason: reason.clone(),
            }),
        }
    }

    /// Marks `id` as this build's own schema, so frames carrying it need no fetch. Written
    /// and read with the same schema, a body needs no resolving: the reader decodes straight
    /// to it (resolving cost the processor 5% of its CPU, for nothing).
    fn insert_own(&self, id: u32) -> Result<(), apache_avro::Error> {
        let own = GenericDatumReader::builder(T::schema()).build()?;
        let mut writers = self.writers.write().expect("schema cache poisoned");
        writers.insert(id, Arc::new(WriterSchema::Readable(own)));
        Ok(())
    }

    async fn writer(&self, id: u32) -> Result<Arc<WriterSchema>, DecodeError> {
        if let Some(found) = self.writers.read().expect("schema cache poisoned").get(&id) {
            return Ok(Arc::clone(found));
        }
        let registered = get_schema_by_id(id, &self.settings)
            .await
            .map_err(|e| classify_registry_error(id, &e))?;
        let writer = match Schema::parse_str(&registered.schema) {
            Err(e) => {
                WriterSchema::Unreadable(format!("the registry's schema does not parse: {e}"))
            }
            Ok(schema) => match SchemaCompatibility::can_read(&schema, T::schema()) {
                Err(e) => WriterSchema::Unreadable(e.to_string()),
                Ok(_) => {
                    let schema: &'static Schema = Box::leak(Box::new(schema));
                    match GenericDatumReader::builder(schema).reader_schema(T::schema()).build() {
                        Ok(reader) => WriterSchema::Readable(reader),
                        Err(e) => WriterSchema::Unreadable(e.to_string()),
                    }
                }
            },
        };
        let writer = Arc::new(writer);
        self.writers.write().expect("schema cache poisoned").insert(id, Arc::clone(&writer));
        Ok(writer)
    }
}

/// The reader schema's full name, for error messages.
fn reader_name<T: Record>() -> String {
    match T::schema() {
        Schema::Record(r) => r.name.fullname(None),
        other => format!("{other:?}"),
    }
}

/// Encodes and decodes `T` in the Confluent wire format against a schema registry.
///
/// Cheap to clone; clones share the schema cache.
pub struct Codec<T> {
    decoder: Decoder<T>,
    subject: String,
    /// The id of this build's schema under `subject`.
    id: u32,
    encoder: Arc<GenericDatumWriter<'static>>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        Self {
            decoder: self.decoder.clone(),
            subject: self.subject.clone(),
            id: self.id,
            encoder: Arc::clone(&self.encoder),
        }
    }
}

impl<T> fmt::Debug for Codec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Codec").field("subject", &self.subject).field("id", &self.id).finish()
    }
}

/// Registry settings for `url` with a request timeout, so a hung registry is an error.
///
/// # Errors
/// The HTTP client could not be built.
pub fn registry_settings(url: &str) -> Result<SrSettings, SRCError> {
    registry_settings_with(url, &RegistryAuth::None)
}

/// How jobfold proves who it is to the schema registry.
#[derive(Clone, PartialEq, Eq)]
pub enum RegistryAuth {
    None,
    /// HTTP basic authentication.
    Basic {
        username: String,
        password: Option<String>,
    },
    /// `Authorization: Bearer <token>`.
    Bearer(String),
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::Basic { username, .. } => write!(f, "Basic {{ username: {username:?}, .. }}"),
            Self::Bearer(_) => f.write_str("Bearer(*********)"),
        }
    }
}

/// [`registry_settings`] with credentials.
///
/// # Errors
/// The HTTP client could not be built.
pub fn registry_settings_with(url: &str, auth: &RegistryAuth) -> Result<SrSettings, SRCError> {
    let mut builder = SrSettings::new_builder(url.trim_end_matches('/').to_owned());
    builder.set_timeout(Duration::from_secs(10));
    match auth {
        RegistryAuth::None => {}
        RegistryAuth::Basic { username, password } => {
            builder.set_basic_authorization(username, password.as_deref());
        }
        RegistryAuth::Bearer(token) => {
            builder.set_token_authorization(token);
        }
    }
    builder.build()
}

/// Whether `schema` may be registered under `subject` by the subject's compatibility rule.
///
/// A subject with no version yet takes any schema. Confluent's registry answers so; Apicurio
/// Registry answers 404 for a subject it has never seen, which here means the same: when the
/// registry's own list of subjects does not hold `subject`, the answer is `true`.
///
/// # Errors
/// The registry is unreachable or refuses the request (a 404 for a subject it lists
/// included: then the URL is not the registry's Confluent API).
pub async fn is_compatible(
    settings: &SrSettings,
    subject: &str,
    schema: SuppliedSchema,
) -> Result<bool, SRCError> {
    match is_compatible_schema(settings, subject.to_owned(), schema).await {
        Err(e) if e.error.contains("status 404") => {
            let subjects = get_all_subjects(settings).await?;
            if subjects.iter().any(|s| s == subject) { Err(e) } else { Ok(true) }
        }
        answer => answer,
    }
}

impl<T: Record> Codec<T> {
    /// Registers `T`'s schema under `<topic>-value` and returns a codec writing with it.
    ///
    /// Registering an already registered schema returns its existing id, so every process
    /// calls this at start. The registry refuses (409) a schema that breaks the subject's
    /// compatibility rule.
    ///
    /// # Errors
    /// [`RegisterError`] if the registry is unreachable or refuses the schema.
    pub async fn connect(settings: SrSettings, topic: &str) -> Result<Self, RegisterError> {
        let subject = format!("{topic}-value");
        let schema = SuppliedSchema::new(None, SchemaType::Avro, T::schema_text().to_owned());
        let registered = post_schema(&settings, subject.clone(), schema)
            .await
            .map_err(|cause| RegisterError { subject: subject.clone(), cause })?;
        let build = |e: apache_avro::Error| RegisterError {
            subject: subject.clone(),
            cause: SRCError::non_retryable_with_cause(e, "building the Avro reader and writer"),
        };
        let encoder = GenericDatumWriter::builder(T::schema()).build().map_err(build)?;
        let decoder = Decoder::new(settings);
        decoder.insert_own(registered.id).map_err(build)?;
        Ok(Self { decoder, subject, id: registered.id, encoder: Arc::new(encoder) })
    }

    /// The subject this codec registered its schema under.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The topic this codec was connected for (its subject is `<topic>-value`).
    pub fn topic(&self) -> &str {
        self.subject.strip_suffix("-value").unwrap_or(&self.subject)
    }

    /// The registry id of this build's schema: the id in every frame this codec encodes.
    pub fn schema_id(&self) -> u32 {
        self.id
    }

    /// The decoding half, sharing this codec's cache.
    pub fn decoder(&self) -> &Decoder<T> {
        &self.decoder
    }

    /// Encodes `record` as a Confluent frame.
    ///
    /// # Errors
    /// [`EncodeError`] only if the Rust value does not validate against this build's own
    /// schema, which the round-trip tests rule out.
    pub fn encode(&self, record: &T) -> Result<Vec<u8>, EncodeError> {
        let body = self
            .encoder
            .write_value_to_vec(record.to_value())
            .map_err(|e| EncodeError(Box::new(e)))?;
        Ok(frame(self.id, &body))
    }

    /// See [`Decoder::decode`].
    ///
    /// # Errors
    /// A [`DecodeError`]; see [`DecodeError::is_retryable`].
    pub async fn decode(&self, frame: &[u8]) -> Result<T, DecodeError> {
        self.decoder.decode(frame).await
    }
}

/// A 404 means the id does not exist (poison); anything else may heal (retry).
fn classify_registry_error(id: u32, e: &SRCError) -> DecodeError {
    if !e.retriable && e.error.contains("status 404") {
        DecodeError::UnknownSchemaId { id }
    } else {
        DecodeError::RegistryUnreachable { id, reason: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncated_frames_are_rejected() {
        for len in 0..HEADER_LEN {
            let frame = vec![0u8; len];
            assert_eq!(split_frame(&frame), Err(DecodeError::Truncated { len }));
        }
    }

    #[test]
    fn bad_magic_byte_is_rejected() {
        assert_eq!(split_frame(&[1, 0, 0, 0, 1, 2]), Err(DecodeError::BadMagicByte { found: 1 }));
    }

    #[test]
    fn frame_and_split_are_inverse() {
        let framed = frame(0x0102_0304, b"body");
        assert_eq!(&framed[..HEADER_LEN], &[0, 1, 2, 3, 4]);
        assert_eq!(split_frame(&framed), Ok((0x0102_0304, &b"body"[..])));
    }

    #[test]
    fn registry_404_is_an_unknown_id_and_not_retryable() {
        let e = SRCError::new(
            "HTTP request to schema registry failed with status 404 Not Found",
            None,
            false,
        );
        let decoded = classify_registry_error(7, &e);
        assert_eq!(decoded, DecodeError::UnknownSchemaId { id: 7 });
        assert!(!decoded.is_retryable());
    }

    #[test]
    fn registry_outage_is_retryable() {
        for e in [
            SRCError::new("error sending request", None, true),
            SRCError::new("HTTP request to schema registry failed with status 500", None, false),
            SRCError::new("HTTP request to schema registry failed with status 401", None, false),
        ] {
            let decoded = classify_registry_error(7, &e);
            assert!(
                matches!(decoded, DecodeError::RegistryUnreachable { id: 7, .. }),
                "{decoded:?}"
            );
            assert!(decoded.is_retryable());
        }
    }

    #[test]
    fn only_registry_outages_are_retryable() {
        let poison = [
            DecodeError::Truncated { len: 0 },
            DecodeError::BadMagicByte { found: 9 },
            DecodeError::UnknownSchemaId { id: 1 },
            DecodeError::IncompatibleSchema { id: 1, reader: "r".into(), reason: "x".into() },
            DecodeError::BodyMismatch { id: 1, reason: "x".into() },
        ];
        assert!(poison.iter().all(|e| !e.is_retryable()));
    }
}
