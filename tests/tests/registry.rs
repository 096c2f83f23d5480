//! The schema registry as other clients see it: Confluent's own Python client
//! (`confluent_kafka.schema_registry`) reads the schema jobfold registered, by the id in a
//! frame and as the subject's latest version, and decodes the frame with it.

use std::path::{Path, PathBuf};
use std::process::Command;

use chrono::{TimeZone, Utc};
use jobfold_schemas::codec::registry_settings;
use jobfold_schemas::event::JobRequested;
use jobfold_schemas::{Codec, JobEvent, Payload};
use jobfold_tests::kafka::unique_name;
use jobfold_tests::services;
use uuid::Uuid;

/// The pinned client, with its Avro and registry extras.
const CLIENT: &str = "confluent-kafka[avro,schemaregistry]==2.16.1";

/// A virtual environment with Confluent's Python client, made once in jobfold's cache
/// directory (PyPI the first time).
fn python_with_confluent() -> PathBuf {
    let cache = std::env::var_os("JOBFOLD_CACHE_DIR").map_or_else(
        || Path::new(&std::env::var("HOME").expect("HOME")).join(".cache/jobfold"),
        PathBuf::from,
    );
    let venv = cache.join("python-confluent-kafka-2.16.1");
    let python = venv.join("bin/python");
    let ready = venv.join(".installed");
    if !ready.exists() {
        let _ = std::fs::remove_dir_all(&venv);
        let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status();
        assert!(made.is_ok_and(|s| s.success()), "python3 -m venv {} failed", venv.display());
        let output = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", CLIENT])
            .output()
            .expect("running pip");
        assert!(
            output.status.success(),
            "pip install {CLIENT}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::fs::write(&ready, CLIENT).unwrap();
    }
    python
}

const READER: &str = r#"
import json, sys
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import SerializationContext, MessageField

url, subject, topic, frame_hex = sys.argv[1:5]
client = SchemaRegistryClient({"url": url})
frame = bytes.fromhex(frame_hex)
schema_id = int.from_bytes(frame[1:5], "big")
by_id = client.get_schema(schema_id)
latest = client.get_latest_version(subject)
record = AvroDeserializer(client)(frame, SerializationContext(topic, MessageField.VALUE))
print(json.dumps({
    "schema_id": schema_id,
    "schema_type": by_id.schema_type,
    "schema_name": json.loads(by_id.schema_str)["name"],
    "latest_id": latest.schema_id,
    "latest_schema_name": json.loads(latest.schema.schema_str)["name"],
    "document_id": record["document_id"],
    "job_kind": record["job_kind"],
    "stream_version": record["stream_version"],
}))
"#;

#[tokio::test]
async fn confluents_python_client_reads_what_jobfold_registered() {
    let url = services::schema_registry_url();
    services::require_url("the schema registry", &url);
    let topic = unique_name("python-reads");
    let codec = Codec::<JobEvent>::connect(registry_settings(&url).unwrap(), &topic).await.unwrap();
    let event = JobEvent {
        event_id: Uuid::new_v4(),
        job_id: Uuid::new_v4(),
        document_id: "doc-python".into(),
        job_kind: "index-document".into(),
        input_version: 1,
        stream_version: 3,
        occurred_at: Utc.timestamp_millis_opt(1_700_000_000_000).unwrap(),
        trace: None,
        producer: "registry-test".into(),
        payload: Payload::JobRequested(JobRequested {
            input: r#"{"text":"x"}"#.into(),
            idempotency_key: None,
            max_attempts: 3,
            deadline: None,
            run_at: None,
        }),
    };
    let frame = codec.encode(&event).unwrap();
    let hex: String = frame.iter().map(|b| format!("{b:02x}")).collect();

    let python = tokio::task::spawn_blocking(python_with_confluent).await.unwrap();
    let output = tokio::process::Command::new(python)
        .args(["-c", READER, &url, codec.subject(), &topic, &hex])
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let read: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(read["schema_id"], codec.schema_id());
    assert_eq!(read["schema_type"], "AVRO");
    assert_eq!(read["schema_name"], "JobEvent");
    assert_eq!(read["latest_id"], codec.schema_id(), "{read}");
    assert_eq!(read["latest_schema_name"], "JobEvent");
    assert_eq!(read["document_id"], "doc-python");
    assert_eq!(read["job_kind"], "index-document");
    assert_eq!(read["stream_version"], 3);
}
