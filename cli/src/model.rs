//! A stand-in model server for the demo and the bench: an OpenAI-compatible
//! `POST /v1/chat/completions` on 127.0.0.1 that `jobfold-examples`' summarize-conversation
//! calls. Each conversation (the text before the first `:` of its first message) answers
//! after the latency planned for it, and its first calls may fail with 503 and
//! `Retry-After: 1`; every call is recorded with its `Idempotency-Key`, so the demo can check
//! that no summary was asked for again after it committed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

/// How one conversation's calls go.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Behaviour {
    pub(crate) latency: Duration,
    /// The first this many calls (per idempotency key) answer 503.
    pub(crate) fail_first: u32,
}

/// One call, as recorded.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) key: String,
    pub(crate) at: DateTime<Utc>,
}

#[derive(Debug, Default)]
struct Shared {
    plan: HashMap<String, Behaviour>,
    calls: Vec<Call>,
    by_key: HashMap<String, u32>,
}

/// The running stand-in.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    pub(crate) url: String,
    shared: Arc<Mutex<Shared>>,
    default: Behaviour,
}

impl Model {
    /// Serves on a free port until the process ends; conversations without a plan behave
    /// as `default`.
    pub(crate) async fn start(default: Behaviour) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
        let model = Self { url, shared: Arc::default(), default };
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(complete))
            .with_state(model.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(model)
    }

    /// Plans `conversation`'s calls.
    pub(crate) fn plan(&self, conversation: &str, behaviour: Behaviour) {
        self.lock().plan.insert(conversation.to_owned(), behaviour);
    }

    /// Every call so far.
    pub(crate) fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

async fn complete(
    State(model): State<Model>,
    headers: HeaderMap,
    body: axum::Json<Value>,
) -> Response {
    let key =
        headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    // The first user message: "<conversation>: text".
    let first = body["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let conversation = first.split(':').next().unwrap_or_default().to_owned();
    let (behaviour, nth) = {
        let mut shared = model.lock();
        shared.calls.push(Call { key: key.clone(), at: Utc::now() });
        let nth = shared.by_key.entry(key).or_insert(0);
        *nth += 1;
        let nth = *nth;
        (shared.plan.get(&conversation).copied().unwrap_or(model.default), nth)
    };
    tokio::time::sleep(behaviour.latency).await;
    if nth <= behaviour.fail_first {
        return (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")], "the model is busy")
            .into_response();
    }
    let turns = body["messages"].as_array().map_or(0, |m| m.len().saturating_sub(1));
    axum::Json(json!({
        "model": "stand-in",
        "choices": [{"index": 0, "message": {"role": "assistant",
            "content": format!("{conversation}: {turns} messages about the order; the customer is waiting for a refund.")}}],
    }))
    .into_response()
}
