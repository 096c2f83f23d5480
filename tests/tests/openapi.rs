//! docs/openapi.json describes the API the processor serves: every route of its router is in
//! it with the same methods, every operation it lists reaches a handler of a live router
//! (not the not-found or wrong-method fallback), and every `$ref` resolves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use jobfold_tests::harness::Installation;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec() -> Value {
    let text = std::fs::read_to_string(root().join("docs/openapi.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The routes processor/src/http.rs registers: path → methods. The console's `/ui` assets
/// are left out (pages, not the API).
fn served_routes() -> BTreeMap<String, BTreeSet<String>> {
    let source = std::fs::read_to_string(root().join("processor/src/http.rs")).unwrap();
    let start = source.find("pub fn router(").expect("the router function");
    let end = start + source[start..].find(".merge(crate::console::routes())").expect("its end");
    let mut routes = BTreeMap::new();
    for segment in source[start..end].split(".route(").skip(1) {
        let path = segment.split('"').nth(1).expect("a route's path literal").to_owned();
        // `get(`, `.post(`, … not preceded by a letter, a digit or `_` (a handler's name).
        let methods: BTreeSet<String> = ["get", "post", "delete", "put", "patch"]
            .into_iter()
            .filter(|m| {
                let call = format!("{m}(");
                segment.match_indices(&call).any(|(at, _)| {
                    !segment[..at]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                })
            })
            .map(str::to_owned)
            .collect();
        assert!(!methods.is_empty(), "no method found for {path}");
        routes.insert(path, methods);
    }
    routes
}

fn documented(spec: &Value) -> BTreeMap<String, BTreeSet<String>> {
    spec["paths"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(path, item)| (path.clone(), item.as_object().unwrap().keys().cloned().collect()))
        .collect()
}

#[test]
fn every_route_served_is_documented_with_its_methods() {
    let spec = spec();
    assert_eq!(spec["openapi"], "3.1.0");
    assert_eq!(served_routes(), documented(&spec));
}

#[test]
fn every_reference_resolves() {
    let spec = spec();
    fn walk(value: &Value, spec: &Value, missing: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(target)) = map.get("$ref") {
                    let pointer = target.trim_start_matches('#');
                    if spec.pointer(pointer).is_none() {
                        missing.push(target.clone());
                    }
                }
                map.values().for_each(|v| walk(v, spec, missing));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, spec, missing)),
            _ => {}
        }
    }
    let mut missing = Vec::new();
    walk(&spec, &spec, &mut missing);
    assert_eq!(missing, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_operation_reaches_a_handler() {
    let it = Installation::new("openapi").await;
    let app = jobfold_processor::http::router(it.api_state().await, 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(jobfold_processor::http::serve_on(listener, app, stop.clone()));
    let client = reqwest::Client::new();
    let mut fallbacks = Vec::new();
    for (path, methods) in documented(&spec()) {
        let concrete = path
            .replace(
                "{id}",
                if path.starts_with("/v1/dead-letters") {
                    "0"
                } else {
                    "00000000-0000-7000-8000-000000000000"
                },
            )
            .replace("{kind}", "no-such-kind");
        for method in methods {
            let request = match method.as_str() {
                "get" => client.get(format!("{base}{concrete}")),
                "post" => client.post(format!("{base}{concrete}")),
                "delete" => client.delete(format!("{base}{concrete}")),
                other => panic!("{other} is not served"),
            };
            let answer = request.header("content-type", "application/json").body("{}").send().await;
            let answer = answer.unwrap();
            let status = answer.status().as_u16();
            let said: Value = answer.json().await.unwrap_or(Value::Null);
            let message = said["error"]["message"].as_str().unwrap_or_default();
            if status == 405 || (status == 404 && message.starts_with("no route")) {
                fallbacks.push(format!("{method} {path}: {status} {message}"));
            }
        }
    }
    stop.cancel();
    assert_eq!(fallbacks, Vec::<String>::new(), "documented operations the router does not serve");
    it.cleanup().await;
}
