//! The schema registry as other clients see it, and as a deployment guards it: Confluent's
//! own Python client (`confluent_kafka.schema_registry`) reads the schema jobfold registered,
//! by the id in a frame and as the subject's latest version, and decodes the frame with it;
//! behind a gate that asks for credentials, jobfold's settings get it through.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::response::IntoResponse;
use chrono::{TimeZone, Utc};
use jobfold_common::config::{SecretUrl, Sensitive};
use jobfold_schemas::codec::registry_settings;
use jobfold_schemas::event::JobRequested;
use jobfold_schemas::{Codec, Decoder, JobEvent, Payload};
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

/// A `JobRequested` event of `document`.
fn event(document: &str) -> JobEvent {
    JobEvent {
        event_id: Uuid::new_v4(),
        job_id: Uuid::new_v4(),
        document_id: document.into(),
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
    }
}

#[tokio::test]
async fn confluents_python_client_reads_what_jobfold_registered() {
    let url = services::schema_registry_url();
    services::require_url("the schema registry", &url);
    let topic = unique_name("python-reads");
    let codec = Codec::<JobEvent>::connect(registry_settings(&url).unwrap(), &topic).await.unwrap();
    let frame = codec.encode(&event("doc-python")).unwrap();
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

/// A gate in front of the running registry, as a deployment's proxy puts one: a request
/// whose `Authorization` is not `expected` gets 401 (counted); the others go through to the
/// registry unchanged. Returns the gate's Confluent API URL.
async fn gated_registry(expected: String) -> (String, Arc<AtomicUsize>) {
    let upstream = reqwest::Url::parse(&services::schema_registry_url()).unwrap();
    let origin = format!("http://{}:{}", upstream.host_str().unwrap(), upstream.port().unwrap());
    let refused = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::new();
    let app = axum::Router::new().fallback({
        let refused = Arc::clone(&refused);
        move |request: axum::extract::Request| async move {
            let given = request.headers().get("authorization").and_then(|v| v.to_str().ok());
            if given != Some(expected.as_str()) {
                refused.fetch_add(1, Ordering::SeqCst);
                return (axum::http::StatusCode::UNAUTHORIZED, String::new()).into_response();
            }
            let target = format!("{origin}{}", request.uri());
            let method = request.method().clone();
            let kind = request.headers().get("content-type").cloned();
            let body = axum::body::to_bytes(request.into_body(), 1 << 20).await.unwrap();
            let mut forward = client.request(method, target).body(body);
            if let Some(kind) = kind {
                forward = forward.header("content-type", kind);
            }
            let answer = forward.send().await.unwrap();
            let status = axum::http::StatusCode::from_u16(answer.status().as_u16()).unwrap();
            (status, [("content-type", "application/json")], answer.bytes().await.unwrap())
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}{}", listener.local_addr().unwrap(), upstream.path());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, refused)
}

/// jobfold's registry settings against a registry that asks for credentials: basic
/// authentication from `schema_registry_username`/`_password` or from the URL, a bearer token
/// from `schema_registry_token`; without them the registry refuses and the codec says so.
#[tokio::test]
async fn a_registry_that_asks_for_credentials_gets_them_from_the_settings() {
    services::require_url("the schema registry", &services::schema_registry_url());
    let mut config = jobfold_common::config::Config::load(None).unwrap();
    // What HTTP basic authentication sends for this user and password.
    let request = reqwest::Client::new().get("http://127.0.0.1/");
    let request = request.basic_auth("registry-user", Some("s3cret")).build().unwrap();
    let basic = request.headers()["authorization"].to_str().unwrap().to_owned();
    let (gate, refused) = gated_registry(basic).await;
    let topic = unique_name("gated");

    config.schema_registry_url = SecretUrl::new(gate.clone());
    let denied = Codec::<JobEvent>::connect(config.registry().unwrap(), &topic).await;
    let denied = denied.expect_err("registered without credentials");
    assert!(format!("{denied:#}").contains("401"), "{denied:#}");
    assert_eq!(refused.load(Ordering::SeqCst), 1);

    config.schema_registry_username = Some("registry-user".into());
    config.schema_registry_password = Some(Sensitive::new("s3cret".into()));
    config.validate().unwrap();
    let codec = Codec::<JobEvent>::connect(config.registry().unwrap(), &topic).await.unwrap();
    // A fresh decoder asks the registry for the schema by the id in the frame.
    let frame = codec.encode(&event("doc-gated")).unwrap();
    let decoder = Decoder::<JobEvent>::new(config.registry().unwrap());
    assert_eq!(decoder.decode(&frame).await.unwrap().document_id, "doc-gated");

    // The same credentials written into the URL, sent the same way.
    config.schema_registry_username = None;
    config.schema_registry_password = None;
    config.schema_registry_url =
        SecretUrl::new(gate.replacen("http://", "http://registry-user:s3cret@", 1));
    config.validate().unwrap();
    let again = Codec::<JobEvent>::connect(config.registry().unwrap(), &topic).await.unwrap();
    assert_eq!(again.schema_id(), codec.schema_id());

    // A bearer token.
    let (gate, refused) = gated_registry("Bearer t0ken-for-the-registry".into()).await;
    config.schema_registry_url = SecretUrl::new(gate);
    config.schema_registry_token = Some(Sensitive::new("t0ken-for-the-registry".into()));
    config.validate().unwrap();
    let decoder = Decoder::<JobEvent>::new(config.registry().unwrap());
    assert_eq!(decoder.decode(&frame).await.unwrap().document_id, "doc-gated");
    assert_eq!(refused.load(Ordering::SeqCst), 0);
}
