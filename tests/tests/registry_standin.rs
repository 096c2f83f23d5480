//! The stand-in registry keeps its promises: stable ids across restarts, Confluent errors.

use jobfold_tests::registry_standin::Registry;
use schema_registry_converter::async_impl::schema_registry::{
    SrSettings, get_schema_by_id, post_schema,
};
use schema_registry_converter::schema_registry_common::{SchemaType, SuppliedSchema};

const SCHEMA: &str = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}"#;

/// Serves `registry` on an ephemeral loopback port; returns its base URL.
async fn serve(registry: Registry) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, registry.router()).await.unwrap();
    });
    (url, task)
}

#[tokio::test]
async fn ids_survive_a_restart_with_the_state_file() {
    let dir = std::env::temp_dir().join(format!("jobfold-registry-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("registry.json");
    let schema = SuppliedSchema::new(None, SchemaType::Avro, SCHEMA.to_owned());

    let (url, first) = serve(Registry::persistent(state.clone()).unwrap()).await;
    let id = post_schema(&SrSettings::new(url), "s-value".into(), schema.clone()).await.unwrap().id;
    first.abort();

    let (url, _second) = serve(Registry::persistent(state).unwrap()).await;
    let settings = SrSettings::new(url);
    assert_eq!(get_schema_by_id(id, &settings).await.unwrap().schema, SCHEMA);
    // Registering it again after the restart still finds the same id.
    assert_eq!(post_schema(&settings, "s-value".into(), schema).await.unwrap().id, id);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn unknown_ids_and_bad_schemas_get_confluent_errors() {
    let (url, _task) = serve(Registry::in_memory()).await;
    let client = reqwest::Client::new();
    let call = async |request: reqwest::RequestBuilder| {
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json::<serde_json::Value>().await.unwrap())
    };

    let (status, body) = call(client.get(format!("{url}/schemas/ids/42"))).await;
    assert_eq!((status, &body["error_code"]), (404, &40403.into()));

    let bad = serde_json::json!({ "schema": r#"{"type":"nope"}"# });
    let (status, body) =
        call(client.post(format!("{url}/subjects/s-value/versions")).json(&bad)).await;
    assert_eq!((status, &body["error_code"]), (422, &42201.into()));

    let (status, body) = call(client.get(format!("{url}/subjects/missing/versions/latest"))).await;
    assert_eq!((status, &body["error_code"]), (404, &40401.into()));
}
