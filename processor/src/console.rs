//! The operator console at `/ui`: one page, a script and a style sheet, built into the
//! binary (no CDN, nothing fetched at run time). The page reads and acts only through the
//! HTTP API beside it (`/v1/...`), so it shows what the API returns and can do no more than
//! the API lets a caller do.
//!
//! - Everything it shows is set as text, never as markup: job inputs, document ids and
//!   errors are user data. The content security policy allows only this origin's script and
//!   style, so even a missed escape could not run an injected script.
//! - With tokens configured, every call needs one like any API call: the sign-in form checks
//!   it (`POST /v1/auth`, which names its role) and keeps it in the tab's session storage,
//!   sent only as an `Authorization` header: never in a URL or a cookie, so another site
//!   cannot make the browser send it (and the API refuses mutating requests from other
//!   origins anyway). The page offers only what the role may do; the API decides.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

const INDEX_HTML: &str = include_str!("../ui/index.html");
const CONSOLE_JS: &str = include_str!("../ui/console.js");
const CONSOLE_CSS: &str = include_str!("../ui/console.css");

/// What the page may load and do: its own script, style and API, nothing inline, no frames.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

/// The console's routes, for a router of any state: the page needs none of its own.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }))
        .route(
            "/ui/console.js",
            get(|| async { asset(CONSOLE_JS, "text/javascript; charset=utf-8") }),
        )
        .route("/ui/console.css", get(|| async { asset(CONSOLE_CSS, "text/css; charset=utf-8") }))
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let headers = response.headers_mut();
    headers
        .insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // The assets change with the binary: a browser asks again rather than run an old script
    // against a newer API.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
