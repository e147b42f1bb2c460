//! The board (`/ui`): one page that shows the cluster (racks, leaves,
//! nodes and GPUs by owner group; queues, pending jobs and quotas; recent
//! events, live; a job's ranks, master address and log tail), for people
//! with a browser. Its HTML, script and style are built into the binary and
//! served from this replica only (nothing from other sites: the page's
//! Content-Security-Policy forbids it). The page reads the REST API as the
//! signed-in user (see [`super::session`]), so it shows each viewer what
//! their role may see.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use http::{header, HeaderName, HeaderValue};

use super::session;
use super::Rest;

/// Served with every board file: only this replica's own files, no
/// framing, no inline script or style, no referrer to other sites.
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; object-src 'none'";

const INDEX_HTML: &str = include_str!("../../ui/index.html");
const BOARD_JS: &str = include_str!("../../ui/board.js");
const BOARD_CSS: &str = include_str!("../../ui/board.css");

pub fn routes() -> Router<Arc<Rest>> {
    Router::new()
        .route("/ui", get(|| async { file(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/ui/", get(|| async { file(INDEX_HTML, "text/html; charset=utf-8") }))
        .route("/ui/board.js", get(|| async { file(BOARD_JS, "text/javascript; charset=utf-8") }))
        .route("/ui/board.css", get(|| async { file(BOARD_CSS, "text/css; charset=utf-8") }))
        .route("/ui/session", get(session::current).post(session::sign_in).delete(session::sign_out))
}

/// A board file with the headers that keep it to itself.
fn file(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    for (name, value) in security_headers() {
        headers.insert(name, value);
    }
    response
}

fn security_headers() -> [(HeaderName, HeaderValue); 5] {
    [
        (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY)),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
        // A new build's page is fetched again; no copy outlives a sign-out.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page loads nothing from elsewhere: no URL of another site, no
    /// inline script or style (the policy would refuse them anyway, and
    /// the page would break).
    #[test]
    fn the_page_is_self_contained() {
        for (name, text) in [("index.html", INDEX_HTML), ("board.js", BOARD_JS), ("board.css", BOARD_CSS)] {
            for outside in ["http://", "https://", "//cdn", "@import", "url("] {
                assert!(!text.contains(outside), "{name} names {outside}");
            }
        }
        assert!(!INDEX_HTML.contains("<script>") && !INDEX_HTML.contains("style="), "inline script or style in index.html");
        assert!(INDEX_HTML.contains(r#"<script src="/ui/board.js""#));
    }

    /// Shown to fail with the policy header left out of [`security_headers`]
    /// (no `content-security-policy` header: the lookup panicked).
    #[test]
    fn board_files_carry_the_policy() {
        let response = file(INDEX_HTML, "text/html; charset=utf-8");
        let csp = response.headers()[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.starts_with("default-src 'self'"), "{csp}");
        assert_eq!(response.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    }
}
