//! The Confluent wire codec against the running schema registry: registration, decoding by
//! the id in the frame, each kind of malformed frame, and BACKWARD compatibility of every
//! released schema as the registry itself judges it.

use std::path::Path;

use chrono::{TimeZone, Utc};
use jobfold_schemas::codec::{frame, is_compatible, registry_settings};
use jobfold_schemas::event::{JobRequested, JobSucceeded, LeaseTaken};
use jobfold_schemas::{Codec, DecodeError, Decoder, JobEvent, JobRequest, Payload};
use jobfold_tests::kafka::unique_name;
use jobfold_tests::services;
use schema_registry_converter::async_impl::schema_registry::{
    SrSettings, get_schema_by_id, post_schema,
};
use schema_registry_converter::schema_registry_common::{SchemaType, SuppliedSchema};
use uuid::Uuid;

fn settings() -> SrSettings {
    let url = services::schema_registry_url();
    services::require_url("the schema registry", &url);
    registry_settings(&url).unwrap()
}

fn event(payload: Payload) -> JobEvent {
    JobEvent {
        event_id: Uuid::new_v4(),
        job_id: Uuid::new_v4(),
        document_id: "doc-42".into(),
        job_kind: "index-document".into(),
        input_version: 3,
        stream_version: 1,
        occurred_at: Utc.timestamp_millis_opt(1_764_000_000_123).unwrap(),
        trace: None,
        producer: "codec-test".into(),
        payload,
    }
}

fn requested() -> JobEvent {
    event(Payload::JobRequested(JobRequested {
        input: r#"{"text":"hello"}"#.into(),
        idempotency_key: Some("k".into()),
        max_attempts: 5,
        deadline: None,
        run_at: None,
    }))
}

#[tokio::test]
async fn events_round_trip_through_the_registry() {
    let topic = unique_name("codec");
    let codec = Codec::<JobEvent>::connect(settings(), &topic).await.unwrap();
    assert_eq!(codec.subject(), format!("{topic}-value"));

    // Registering again (every process does at start) finds the same id.
    let again = Codec::<JobEvent>::connect(settings(), &topic).await.unwrap();
    assert_eq!(again.schema_id(), codec.schema_id());

    // The id in the frame is the registry's id for our schema.
    let original = requested();
    let framed = codec.encode(&original).unwrap();
    assert_eq!(framed[0], 0);
    assert_eq!(u32::from_be_bytes(framed[1..5].try_into().unwrap()), codec.schema_id());
    let registered = get_schema_by_id(codec.schema_id(), &settings()).await.unwrap();
    assert_eq!(
        apache_avro::Schema::parse_str(&registered.schema).unwrap().canonical_form(),
        jobfold_schemas::event::JOB_EVENT_SCHEMA.canonical_form()
    );

    // A fresh decoder, knowing nothing, fetches the writer schema by id.
    let decoder = Decoder::<JobEvent>::new(settings());
    assert_eq!(decoder.decode(&framed).await.unwrap(), original);
    for lease in [
        None,
        // A run that ended inside its lease transaction: the success says its lease.
        Some(LeaseTaken {
            lease_owner: "host-1/42".into(),
            leased_at: Utc.timestamp_millis_opt(1_700_000_000_123).unwrap(),
            dispatch_event_id: Uuid::now_v7(),
        }),
    ] {
        let succeeded = event(Payload::JobSucceeded(JobSucceeded {
            generation: 2,
            attempt: 2,
            result: "{}".into(),
            lease,
        }));
        assert_eq!(decoder.decode(&codec.encode(&succeeded).unwrap()).await.unwrap(), succeeded);
    }
}

#[tokio::test]
async fn job_requests_round_trip_through_the_registry() {
    let topic = unique_name("intake");
    let codec = Codec::<JobRequest>::connect(settings(), &topic).await.unwrap();
    let request = JobRequest {
        request_id: Uuid::new_v4(),
        document_id: "doc-1".into(),
        job_kind: "index-document".into(),
        input_version: 1,
        input: "{}".into(),
        requested_at: Utc.timestamp_millis_opt(1_764_000_000_000).unwrap(),
        producer: "upstream".into(),
        trace: None,
        run_at: None,
    };
    let framed = codec.encode(&request).unwrap();
    assert_eq!(Decoder::<JobRequest>::new(settings()).decode(&framed).await.unwrap(), request);
}

#[tokio::test]
async fn each_malformed_frame_gets_its_own_error() {
    let topic = unique_name("poison");
    let codec = Codec::<JobEvent>::connect(settings(), &topic).await.unwrap();
    let good = codec.encode(&requested()).unwrap();

    let truncated = codec.decode(&good[..3]).await.unwrap_err();
    assert_eq!(truncated, DecodeError::Truncated { len: 3 });

    let mut bad_magic = good.clone();
    bad_magic[0] = b'{';
    assert_eq!(
        codec.decode(&bad_magic).await.unwrap_err(),
        DecodeError::BadMagicByte { found: b'{' }
    );

    let unknown = frame(u32::MAX - 7, &good[5..]);
    assert_eq!(
        codec.decode(&unknown).await.unwrap_err(),
        DecodeError::UnknownSchemaId { id: u32::MAX - 7 }
    );

    // Garbage after a valid header, and trailing bytes after a valid record.
    let garbage = frame(codec.schema_id(), &[0xff; 3]);
    assert!(matches!(codec.decode(&garbage).await, Err(DecodeError::BodyMismatch { .. })));
    let mut trailing = good.clone();
    trailing.extend_from_slice(b"extra");
    let err = codec.decode(&trailing).await.unwrap_err();
    assert!(
        matches!(&err, DecodeError::BodyMismatch { reason, .. } if reason.contains("left")),
        "{err}"
    );

    // A frame written with some other registered schema, which ours cannot read.
    let other = r#"{"type":"record","name":"Other","fields":[{"name":"x","type":"int"}]}"#;
    let registered = post_schema(
        &settings(),
        format!("{topic}-other-value"),
        SuppliedSchema::new(None, SchemaType::Avro, other.into()),
    )
    .await
    .unwrap();
    let foreign = frame(registered.id, &[0x02]);
    let err = codec.decode(&foreign).await.unwrap_err();
    assert!(
        matches!(err, DecodeError::IncompatibleSchema { id, .. } if id == registered.id),
        "{err}"
    );

    for poison in [truncated, err] {
        assert!(!poison.is_retryable(), "{poison} must be dead-lettered, not retried");
    }
}

#[tokio::test]
async fn an_unreachable_registry_is_retryable() {
    // Nothing listens on port 1; the decoder has no cached schema, so it must ask.
    let decoder = Decoder::<JobEvent>::new(registry_settings("http://127.0.0.1:1").unwrap());
    let err = decoder.decode(&frame(1, &[0])).await.unwrap_err();
    assert!(matches!(err, DecodeError::RegistryUnreachable { id: 1, .. }), "{err}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn the_registry_accepts_every_released_schema_in_order_then_the_current_one() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schemas");
    for stem in ["job_event", "job_request"] {
        let subject = format!("{}-value", unique_name(stem));
        let mut versions: Vec<(u32, String)> = std::fs::read_dir(dir.join("history"))
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                let v =
                    name.strip_prefix(&format!("{stem}.v"))?.strip_suffix(".avsc")?.parse().ok()?;
                Some((v, name))
            })
            .collect();
        versions.sort();
        assert!(!versions.is_empty());
        for (_, name) in &versions {
            let text = std::fs::read_to_string(dir.join("history").join(name)).unwrap();
            let schema = SuppliedSchema::new(None, SchemaType::Avro, text);
            assert!(
                is_compatible(&settings(), &subject, schema.clone()).await.unwrap(),
                "{name} is not BACKWARD compatible with the versions before it"
            );
            post_schema(&settings(), subject.clone(), schema).await.unwrap();
        }
        let current = std::fs::read_to_string(dir.join(format!("{stem}.avsc"))).unwrap();
        let current = SuppliedSchema::new(None, SchemaType::Avro, current);
        assert!(is_compatible(&settings(), &subject, current).await.unwrap());
    }
}

/// A subject with no version yet takes any schema: Confluent's registry answers so, and
/// Apicurio Registry's 404 for a subject it never saw means the same. Once a version is
/// registered, the subject's rule (BACKWARD) judges: a new required field is refused.
#[tokio::test]
async fn a_subject_with_no_version_takes_any_schema_then_its_rule_judges() {
    let subject = format!("{}-value", unique_name("fresh"));
    let v1 = r#"{"type":"record","name":"Fresh","fields":[{"name":"a","type":"string"}]}"#;
    let breaking = r#"{"type":"record","name":"Fresh","fields":[{"name":"a","type":"string"},{"name":"b","type":"long"}]}"#;
    let avro = |text: &str| SuppliedSchema::new(None, SchemaType::Avro, text.to_owned());
    assert!(is_compatible(&settings(), &subject, avro(v1)).await.unwrap());
    post_schema(&settings(), subject.clone(), avro(v1)).await.unwrap();
    assert!(!is_compatible(&settings(), &subject, avro(breaking)).await.unwrap());
}
