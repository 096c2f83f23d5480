//! The schemas and the Rust types agree, and every released schema stays readable.
//!
//! - every `.avsc` (current and `history/`) parses;
//! - every Rust value round-trips through apache-avro with the current schema (proptest), so
//!   the hand-written conversion cannot drift from the `.avsc` files;
//! - samples written with every historical writer schema, covering every union branch and
//!   enum symbol, are read by the current reader schema into the Rust types (BACKWARD).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use apache_avro::Schema;
use apache_avro::schema::{Name, ResolvedSchema};
use apache_avro::schema_compatibility::SchemaCompatibility;
use apache_avro::types::Value;
use common::{job_event, job_request, proptest_config};
use jobfold_schemas::codec::{decode_body, encode_body};
use jobfold_schemas::event::{JOB_EVENT_SCHEMA, JOB_REQUEST_SCHEMA};
use jobfold_schemas::{JobEvent, JobRequest, Record};
use proptest::prelude::*;

fn schema_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// `history/<stem>.v<N>.avsc`, oldest first.
fn history(stem: &str) -> Vec<(PathBuf, Schema)> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(schema_dir().join("history"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?.to_owned();
            let version = name.strip_prefix(&format!("{stem}.v"))?.strip_suffix(".avsc")?;
            Some((version.parse().ok()?, path))
        })
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no history/{stem}.v*.avsc: the released versions must be kept");
    found
        .into_iter()
        .map(|(_, path)| {
            let text = std::fs::read_to_string(&path).unwrap();
            let schema = Schema::parse_str(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            (path, schema)
        })
        .collect()
}

#[test]
fn every_schema_file_parses() {
    for name in ["job_event.avsc", "job_request.avsc"] {
        let text = std::fs::read_to_string(schema_dir().join(name)).unwrap();
        Schema::parse_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(!history("job_event").is_empty());
    assert!(!history("job_request").is_empty());
}

#[test]
fn the_newest_history_entry_is_the_current_schema() {
    // A schema change must add a history entry: the newest one equals the current file.
    for (stem, current) in
        [("job_event", &*JOB_EVENT_SCHEMA), ("job_request", &*JOB_REQUEST_SCHEMA)]
    {
        let (path, newest) = history(stem).pop().unwrap();
        assert_eq!(
            newest.canonical_form(),
            current.canonical_form(),
            "{stem}.avsc changed: copy it to history/ as the next version (after {})",
            path.display()
        );
    }
}

fn round_trip<T: Record + PartialEq + std::fmt::Debug>(record: &T) -> T {
    let body = encode_body(T::schema(), record.to_value()).expect("the value fits the schema");
    decode_body::<T>(1, T::schema(), &body).expect("the body decodes")
}

proptest! {
    #![proptest_config(proptest_config(1024))]

    #[test]
    fn job_events_round_trip_through_avro(event in job_event()) {
        prop_assert_eq!(round_trip(&event), event);
    }

    #[test]
    fn job_requests_round_trip_through_avro(request in job_request()) {
        prop_assert_eq!(round_trip(&request), request);
    }
}

/// Sample values for `schema`: together they take every union branch and enum symbol.
fn samples(schema: &Schema, names: &HashMap<Name, &Schema>) -> Vec<Value> {
    match schema {
        Schema::Null => vec![Value::Null],
        Schema::Boolean => vec![Value::Boolean(true)],
        Schema::Int => vec![Value::Int(3)],
        Schema::Long => vec![Value::Long(7)],
        Schema::String => vec![Value::String("{\"sample\":true}".into())],
        Schema::Uuid(_) => vec![Value::Uuid(uuid::Uuid::from_u128(0x1234))],
        Schema::TimestampMillis => vec![Value::TimestampMillis(1_700_000_000_000)],
        Schema::Enum(e) => {
            e.symbols.iter().enumerate().map(|(i, s)| Value::Enum(i as u32, s.clone())).collect()
        }
        Schema::Union(u) => u
            .variants()
            .iter()
            .enumerate()
            .flat_map(|(i, variant)| {
                samples(variant, names)
                    .into_iter()
                    .map(move |v| Value::Union(i as u32, Box::new(v)))
            })
            .collect(),
        Schema::Record(r) => {
            let per_field: Vec<Vec<Value>> =
                r.fields.iter().map(|f| samples(&f.schema, names)).collect();
            let count = per_field.iter().map(Vec::len).max().unwrap_or(1);
            (0..count)
                .map(|k| {
                    Value::Record(
                        r.fields
                            .iter()
                            .zip(&per_field)
                            .map(|(f, values)| (f.name.clone(), values[k % values.len()].clone()))
                            .collect(),
                    )
                })
                .collect()
        }
        Schema::Ref { name } => samples(names[name], names),
        other => panic!("extend the sample generator for {other:?}"),
    }
}

/// Every sample of every historical writer schema reads into the current Rust type.
fn old_writers_are_readable<T: Record>(stem: &str) {
    for (path, writer) in history(stem) {
        let resolved = ResolvedSchema::try_from(&writer).unwrap();
        let names: HashMap<Name, &Schema> =
            resolved.get_names().iter().map(|(k, v)| (k.clone(), *v)).collect();
        SchemaCompatibility::can_read(&writer, T::schema()).unwrap_or_else(|e| {
            panic!("{} cannot be read with the current schema: {e}", path.display())
        });
        let values = samples(&writer, &names);
        assert!(!values.is_empty());
        for value in values {
            let body = encode_body(&writer, value.clone())
                .unwrap_or_else(|e| panic!("{}: sample does not fit: {e}", path.display()));
            decode_body::<T>(1, &writer, &body)
                .unwrap_or_else(|e| panic!("{}: {value:?} unreadable: {e}", path.display()));
        }
    }
}

#[test]
fn every_historical_job_event_is_readable_now() {
    old_writers_are_readable::<JobEvent>("job_event");
}

#[test]
fn every_historical_job_request_is_readable_now() {
    old_writers_are_readable::<JobRequest>("job_request");
}

#[test]
fn the_samples_cover_every_payload_branch() {
    let (_, writer) = history("job_event").pop().unwrap();
    let resolved = ResolvedSchema::try_from(&writer).unwrap();
    let names: HashMap<Name, &Schema> =
        resolved.get_names().iter().map(|(k, v)| (k.clone(), *v)).collect();
    let kinds: std::collections::BTreeSet<&str> = samples(&writer, &names)
        .into_iter()
        .map(|value| {
            let body = encode_body(&writer, value).unwrap();
            let payload = decode_body::<JobEvent>(1, &writer, &body).unwrap().payload;
            // What a processor passes over by its `jobfold-event` header is what it would
            // drop after decoding.
            assert_eq!(
                jobfold_schemas::Payload::is_dispatch_kind(payload.kind().as_bytes()),
                payload.is_dispatch(),
                "{}",
                payload.kind()
            );
            payload.kind()
        })
        .collect();
    assert_eq!(kinds.len(), 10, "{kinds:?}");
}

#[test]
fn a_breaking_change_is_caught() {
    // The check above must be able to fail: a new field without a default breaks BACKWARD.
    let text = jobfold_schemas::event::JOB_REQUEST_SCHEMA_TEXT.replacen(
        r#""fields": ["#,
        r#""fields": [{"name": "new_required", "type": "string"},"#,
        1,
    );
    let breaking = Schema::parse_str(&text).unwrap();
    let (_, old) = history("job_request").pop().unwrap();
    assert!(SchemaCompatibility::can_read(&old, &breaking).is_err());
}

proptest! {
    #![proptest_config(proptest_config(2048))]

    /// Arbitrary bytes never panic the decoder: they decode or fail with an error.
    /// (`schemas/fuzz` runs the same target under libFuzzer for longer.)
    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok((id, body)) = jobfold_schemas::codec::split_frame(&bytes) {
            let _ = decode_body::<JobEvent>(id, &JOB_EVENT_SCHEMA, body);
            let _ = decode_body::<JobRequest>(id, &JOB_REQUEST_SCHEMA, body);
        }
    }

    /// Valid frames cut short or flipped anywhere fail cleanly too.
    #[test]
    fn damaged_frames_never_panic_the_decoder(
        event in job_event(),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        mask in 1u8..,
    ) {
        let mut body = encode_body(&JOB_EVENT_SCHEMA, jobfold_schemas::Record::to_value(&event)).unwrap();
        let at = flip.index(body.len());
        body[at] ^= mask;
        let _ = decode_body::<JobEvent>(1, &JOB_EVENT_SCHEMA, &body);
        body.truncate(cut.index(body.len()));
        let _ = decode_body::<JobEvent>(1, &JOB_EVENT_SCHEMA, &body);
    }
}
