//! Browser sessions for the board (`/ui`): a browser's `EventSource` sends
//! no `Authorization` header, so a person signs in once (`POST
//! /ui/session` with a bearer token, or with the client certificate the
//! browser shows) and gets a session cookie that authenticates REST
//! requests, the event stream included, as the identity it was issued for.
//!
//! * The cookie is `HttpOnly; SameSite=Strict; Path=/`, `Secure` when the
//!   listener speaks TLS; its value is a random 256-bit id. The table keeps
//!   only the SHA-256 of each id, so neither a dump of it nor the time a
//!   lookup takes tells an id.
//! * Every state-changing request made with the cookie (any method but
//!   GET, HEAD and OPTIONS) must carry the session's CSRF token in
//!   `X-CSRF-Token`; without it, or with another one, it is refused 403.
//! * A session holds its caller (the bearer token or the certificate's
//!   identity), not a verdict: each request is checked as that caller's
//!   own would be, so a revoked token or a changed role takes effect at once.
//! * The table lives in this replica's memory, bounded in count
//!   ([`MAX_SESSIONS`], at most [`MAX_SESSIONS_PER_CALLER`] for one caller)
//!   and in time ([`SESSION_TTL_MS`]). It is not replicated: a board
//!   follows the replica it was opened on, and a cookie from another
//!   replica (or from before a restart) is unknown here (401), so the page
//!   asks to sign in again.
//! * A request that carries `Authorization` is authenticated by it alone;
//!   the cookie is then not looked at.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use ring::digest::{digest, SHA256};
use ring::rand::{SecureRandom, SystemRandom};
use rota_proto::v1 as pb;
use rota_proto::v1::auth_service_server::AuthService;
use rota_tls::{Caller, ConnInfo, Peer};
use serde::Serialize;

use super::inbound::Inbound;
use super::problem::Problem;
use super::Rest;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "rota_session";
/// The request header that must carry the session's CSRF token.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// Sessions kept at once on one replica; the oldest goes when full.
pub const MAX_SESSIONS: usize = 10_000;
/// Sessions of one caller at once; its oldest goes when it signs in again.
pub const MAX_SESSIONS_PER_CALLER: usize = 32;
/// How long a session lasts from sign-in.
pub const SESSION_TTL_MS: u64 = 12 * 60 * 60 * 1_000;
/// Random bytes in a session id and in a CSRF token.
const SECRET_BYTES: usize = 32;
/// The sign-in form's largest body, bytes (a token is 82).
const MAX_SIGN_IN_BYTES: usize = 4 * 1024;

/// One signed-in browser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub caller: Caller,
    /// Required in `X-CSRF-Token` on the session's state-changing requests.
    pub csrf_token: String,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
}

/// The sessions of this replica, keyed by the SHA-256 of their ids. Time is
/// a parameter: the table reads no clock.
#[derive(Debug, Default)]
pub struct SessionTable {
    sessions: HashMap<[u8; 32], Session>,
}

/// Why a cookie did not authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Unknown,
    Expired,
}

impl SessionTable {
    /// Add a session for `caller` under `id`, made at `now_ms`; makes room
    /// first (expired sessions, then the caller's oldest past its share,
    /// then the oldest of all).
    pub fn insert(&mut self, id: &str, caller: Caller, csrf_token: String, now_ms: u64) -> Session {
        self.sessions.retain(|_, s| s.expires_at_ms > now_ms);
        let same_caller = |s: &Session, c: &Caller| &s.caller == c;
        while self.sessions.values().filter(|s| same_caller(s, &caller)).count() >= MAX_SESSIONS_PER_CALLER {
            let Some(oldest) = self.oldest(|s| same_caller(s, &caller)) else { break };
            self.sessions.remove(&oldest);
        }
        while self.sessions.len() >= MAX_SESSIONS {
            let Some(oldest) = self.oldest(|_| true) else { break };
            self.sessions.remove(&oldest);
        }
        let session = Session { caller, csrf_token, created_at_ms: now_ms, expires_at_ms: now_ms.saturating_add(SESSION_TTL_MS) };
        self.sessions.insert(key(id), session.clone());
        session
    }

    fn oldest(&self, matching: impl Fn(&Session) -> bool) -> Option<[u8; 32]> {
        self.sessions.iter().filter(|(_, s)| matching(s)).min_by_key(|(_, s)| s.created_at_ms).map(|(k, _)| *k)
    }

    /// The live session of `id` at `now_ms`; an expired one is dropped.
    pub fn get(&mut self, id: &str, now_ms: u64) -> Result<Session, Refusal> {
        let key = key(id);
        let session = self.sessions.get(&key).ok_or(Refusal::Unknown)?;
        if session.expires_at_ms <= now_ms {
            self.sessions.remove(&key);
            return Err(Refusal::Expired);
        }
        Ok(session.clone())
    }

    pub fn remove(&mut self, id: &str) -> bool {
        self.sessions.remove(&key(id)).is_some()
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }
}

fn key(id: &str) -> [u8; 32] {
    let mut key = [0u8; 32];
    key.copy_from_slice(digest(&SHA256, id.as_bytes()).as_ref());
    key
}

/// Equal, in a time that does not depend on where two strings differ.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// The sessions of this replica and where their secrets come from.
pub struct Sessions {
    table: Mutex<SessionTable>,
    random: SystemRandom,
    /// The clock, a parameter so tests can age sessions.
    now_ms: fn() -> u64,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions::with_clock(crate::clock::wall_clock_ms)
    }
}

impl Sessions {
    pub fn with_clock(now_ms: fn() -> u64) -> Sessions {
        Sessions { table: Mutex::new(SessionTable::default()), random: SystemRandom::new(), now_ms }
    }

    fn secret(&self) -> Result<String, Problem> {
        let mut bytes = [0u8; SECRET_BYTES];
        self.random.fill(&mut bytes).map_err(|_| Problem::from(tonic::Status::internal("no randomness for a session")))?;
        Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// A new session of `caller`: its id (the cookie's value) and itself.
    pub fn create(&self, caller: Caller) -> Result<(String, Session), Problem> {
        let (id, csrf_token) = (self.secret()?, self.secret()?);
        let now_ms = (self.now_ms)();
        let session = self.lock().insert(&id, caller, csrf_token, now_ms);
        Ok((id, session))
    }

    pub fn get(&self, id: &str) -> Result<Session, Refusal> {
        let now_ms = (self.now_ms)();
        self.lock().get(id, now_ms)
    }

    pub fn remove(&self, id: &str) -> bool {
        self.lock().remove(id)
    }

    /// Put a session in as if made at `created_at_ms` (tests age sessions this way).
    #[cfg(test)]
    fn insert_at(&self, caller: Caller, created_at_ms: u64) -> (String, Session) {
        let (id, csrf_token) = (self.secret().unwrap(), self.secret().unwrap());
        let session = self.lock().insert(&id, caller, csrf_token, created_at_ms);
        (id, session)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The caller a valid session cookie stood for, put into the request's
/// extensions by [`authenticate`] and taken by the REST handlers.
#[derive(Debug, Clone)]
pub struct SessionCaller(pub Caller);

/// The session id a request's `Cookie` headers carry, if any.
pub fn cookie_session_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE_NAME)
        .map(|(_, value)| value.trim().to_string())
}

/// Does a request of `method` change state (and so need the CSRF token)?
fn changes_state(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Paths a session cookie is looked at on: the API and the session itself.
/// The board's page and files and the OpenAPI document are served to
/// anyone (they hold no data), so a stale cookie never keeps a browser
/// from the sign-in form.
fn cookie_applies(path: &str) -> bool {
    (path.starts_with("/v1/") && path != "/v1/openapi.json") || path == "/ui/session"
}

/// Middleware: a request with a session cookie (and no `Authorization`) is
/// authenticated by it, or refused: 401 for an unknown or expired session,
/// 403 for a state-changing request without the session's CSRF token.
pub async fn authenticate(State(sessions): State<Arc<Sessions>>, mut request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let is_sign_in = path == "/ui/session" && request.method() == Method::POST;
    if !cookie_applies(path) || is_sign_in || request.headers().contains_key(header::AUTHORIZATION) {
        return next.run(request).await;
    }
    let Some(id) = cookie_session_id(request.headers()) else { return next.run(request).await };
    let session = match sessions.get(&id) {
        Ok(session) => session,
        Err(refusal) => {
            let detail = match refusal {
                Refusal::Unknown => {
                    "the session cookie names no session of this replica (a board follows the replica it signed in on); sign in again"
                }
                Refusal::Expired => "the session has expired; sign in again",
            };
            drain(request).await;
            let mut response = Problem::from(tonic::Status::unauthenticated(detail)).into_response();
            response.headers_mut().insert(header::SET_COOKIE, clearing_cookie());
            return response;
        }
    };
    if changes_state(request.method()) {
        let sent = request.headers().get(CSRF_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !same_secret(sent, &session.csrf_token) {
            let what = if sent.is_empty() { "is missing" } else { "does not match this session's" };
            let problem = Problem {
                field: Some("X-CSRF-Token".into()),
                ..Problem::new(
                    StatusCode::FORBIDDEN,
                    "csrf",
                    format!("X-CSRF-Token {what}: a change made with the session cookie needs the session's CSRF token in the X-CSRF-Token header"),
                )
            };
            drain(request).await;
            return problem.into_response();
        }
    }
    request.extensions_mut().insert(SessionCaller(session.caller));
    next.run(request).await
}

/// Read a refused request's body (at most the API's largest) before
/// answering: a client still sending one that is answered early gets its
/// HTTP/2 stream reset, and some report that instead of the answer.
async fn drain(request: Request) {
    let body = http_body_util::Limited::new(request.into_body(), super::MAX_BODY_BYTES);
    let _ = http_body_util::BodyExt::collect(body).await;
}

/// The `Set-Cookie` value of a new session.
fn session_cookie(id: &str, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    let max_age_s = SESSION_TTL_MS / 1_000;
    HeaderValue::try_from(format!("{COOKIE_NAME}={id}; HttpOnly{secure}; SameSite=Strict; Path=/; Max-Age={max_age_s}"))
        .unwrap_or_else(|_| clearing_cookie())
}

/// The `Set-Cookie` value that makes a browser forget the session.
fn clearing_cookie() -> HeaderValue {
    HeaderValue::from_static("rota_session=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0")
}

/// What a signed-in page learns about its session.
#[derive(Debug, Serialize)]
pub struct SessionInfo {
    /// Empty on a replica started `--insecure`.
    pub user: String,
    pub role: String,
    pub groups: Vec<String>,
    /// "token", "certificate" or "insecure".
    pub authenticated_by: String,
    /// Send in `X-CSRF-Token` with every state-changing request.
    pub csrf_token: String,
    pub expires_at_ms: u64,
    /// A board follows this replica: its sessions are its own.
    pub replica_id: u64,
}

async fn session_info(rest: &Rest, inbound: &Inbound, session: &Session) -> Result<SessionInfo, Problem> {
    let me = rest.auth.who_am_i(inbound.request(pb::WhoAmIRequest {})).await?.into_inner();
    Ok(SessionInfo {
        user: me.user,
        role: me.role,
        groups: me.groups,
        authenticated_by: me.authenticated_by,
        csrf_token: session.csrf_token.clone(),
        expires_at_ms: session.expires_at_ms,
        replica_id: rest.replica_id(),
    })
}

/// Refuse a sign-in posted from another site's page (login CSRF): a
/// browser names the page's origin in `Origin`; it must be this host.
/// The host is `Host` over HTTP/1.1, the URI's authority over HTTP/2.
fn check_same_origin(uri: &http::Uri, headers: &HeaderMap) -> Result<(), Problem> {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else { return Ok(()) };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).or_else(|| uri.authority().map(|a| a.as_str())).unwrap_or("");
    let origin_host = origin.split_once("://").map(|(_, rest)| rest).unwrap_or("");
    if host.is_empty() || origin_host != host {
        return Err(Problem {
            field: Some("Origin".into()),
            ..Problem::new(StatusCode::FORBIDDEN, "cross_origin", format!("Origin: a sign-in from {origin:?} is not from this board"))
        });
    }
    Ok(())
}

/// `POST /ui/session`: sign in with the form field `token` (a bearer
/// token), or with the client certificate (or `Authorization`) of the request.
pub async fn sign_in(State(rest): State<Arc<Rest>>, parts: Parts, body: Body) -> Result<Response, Problem> {
    let bytes = match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, MAX_SIGN_IN_BYTES)).await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Err(Problem::too_large(MAX_SIGN_IN_BYTES)),
    };
    check_same_origin(&parts.uri, &parts.headers)?;
    let conn = parts.extensions.get::<ConnInfo>().ok_or_else(|| Problem::from(tonic::Status::unauthenticated("no connection")))?;
    let token = form_urlencoded::parse(&bytes).find(|(name, _)| name == "token").map(|(_, value)| value.trim().to_string());
    let inbound = match token.filter(|t| !t.is_empty()) {
        // A token in the form stands for `Authorization: Bearer TOKEN`.
        Some(token) => {
            let mut headers = HeaderMap::new();
            let value = HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| Problem::invalid("token", "token: not a token"))?;
            headers.insert(header::AUTHORIZATION, value);
            Inbound::authenticate(conn, &headers)?
        }
        None => Inbound::authenticate(conn, &parts.headers)?,
    };
    // Check the credentials now (a wrong token is refused here, not on the first read).
    rest.auth.who_am_i(inbound.request(pb::WhoAmIRequest {})).await?;
    // Signing in again replaces this browser's session.
    if let Some(old) = cookie_session_id(&parts.headers) {
        rest.sessions.remove(&old);
    }
    let (id, session) = rest.sessions.create(inbound.caller.clone())?;
    let info = session_info(&rest, &Inbound::for_session(session.caller.clone(), inbound.remote), &session).await?;
    let secure = !matches!(conn.peer, Peer::Plaintext);
    let mut response = (StatusCode::CREATED, Json(info)).into_response();
    response.headers_mut().insert(header::SET_COOKIE, session_cookie(&id, secure));
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// `GET /ui/session`: the signed-in user and the session's CSRF token
/// (a reloaded page has lost it; only a same-origin page can read it).
pub async fn current(State(rest): State<Arc<Rest>>, parts: Parts) -> Result<Response, Problem> {
    let (_, session) = session_of(&rest, &parts)?;
    let conn = parts.extensions.get::<ConnInfo>();
    let inbound = Inbound::for_session(session.caller.clone(), conn.and_then(|c| c.remote));
    let mut response = Json(session_info(&rest, &inbound, &session).await?).into_response();
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// `DELETE /ui/session`: sign out (the middleware checked the CSRF token).
pub async fn sign_out(State(rest): State<Arc<Rest>>, parts: Parts) -> Result<Response, Problem> {
    let (id, _) = session_of(&rest, &parts)?;
    rest.sessions.remove(&id);
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(header::SET_COOKIE, clearing_cookie());
    Ok(response)
}

fn session_of(rest: &Rest, parts: &Parts) -> Result<(String, Session), Problem> {
    let unauthenticated = || Problem::from(tonic::Status::unauthenticated("no session: sign in first (POST /ui/session)"));
    let id = cookie_session_id(&parts.headers).ok_or_else(unauthenticated)?;
    let session = rest.sessions.get(&id).map_err(|_| unauthenticated())?;
    Ok((id, session))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;

    fn bearer(token: &str) -> Caller {
        Caller::Bearer(token.into())
    }

    #[test]
    fn the_table_is_bounded_per_caller_and_in_all_and_forgets_expired_sessions() {
        let mut table = SessionTable::default();
        for i in 0..MAX_SESSIONS_PER_CALLER + 3 {
            table.insert(&format!("a{i}"), bearer("alice"), "c".into(), i as u64);
        }
        assert_eq!(table.len(), MAX_SESSIONS_PER_CALLER);
        assert_eq!(table.get("a0", 100), Err(Refusal::Unknown), "alice's oldest went");
        assert!(table.get(&format!("a{}", MAX_SESSIONS_PER_CALLER + 2), 100).is_ok());
        for i in 0..MAX_SESSIONS {
            table.insert(&format!("u{i}"), bearer(&format!("user-{i}")), "c".into(), 1_000 + i as u64);
        }
        assert_eq!(table.len(), MAX_SESSIONS);
        assert!(table.get("u0", 2_000).is_ok());
        assert!(table.get(&format!("a{}", MAX_SESSIONS_PER_CALLER + 2), 2_000).is_err(), "the oldest of all went");
        let late = SESSION_TTL_MS + 20_000;
        assert_eq!(table.get("u1", late + 1_000), Err(Refusal::Expired));
        table.insert("fresh", bearer("bob"), "c".into(), late + 1_000);
        assert_eq!(table.len(), 1, "expired sessions are dropped when one is made");
    }

    #[test]
    fn secrets_compare_whole_and_cookies_parse() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd") && !same_secret("abc", "ab") && !same_secret("", "a"));
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, "theme=dark; rota_session=0123 ".parse().unwrap());
        assert_eq!(cookie_session_id(&headers).as_deref(), Some("0123"));
        assert_eq!(cookie_session_id(&HeaderMap::new()), None);
    }

    /// A clock 13 hours on from the real one (past every session's TTL).
    fn later_ms() -> u64 {
        crate::clock::wall_clock_ms() + SESSION_TTL_MS + 3_600_000
    }

    /// A router behind the session middleware whose handler answers who
    /// the cookie made the caller ("none" when no session applied).
    fn app(sessions: Arc<Sessions>) -> Router {
        async fn who(request: Request) -> String {
            match request.extensions().get::<SessionCaller>() {
                Some(SessionCaller(Caller::Bearer(token))) => token.clone(),
                Some(SessionCaller(other)) => format!("{other:?}"),
                None => "none".into(),
            }
        }
        Router::new()
            .route("/v1/jobs", get(who).post(who))
            .route("/ui/session", get(who).delete(who))
            .route("/ui", get(who))
            .layer(axum::middleware::from_fn_with_state(sessions, authenticate))
    }

    async fn call(app: &Router, method: Method, path: &str, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, String) {
        let mut request = http::Request::builder().method(method).uri(path);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = app.clone().oneshot(request.body(Body::empty()).unwrap()).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = http_body_util::BodyExt::collect(body).await.unwrap().to_bytes();
        (parts.status, parts.headers, String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Cookie-authenticated changes need the session's own CSRF token.
    ///
    /// Prevents a cross-site form or script from changing state with the
    /// cookie the browser attaches. Shown to fail with the CSRF check of
    /// [`authenticate`] taken out: the POSTs without a token and with
    /// bob's token were let through as alice ("expected 403, got 200").
    #[tokio::test]
    async fn a_cookie_change_needs_the_sessions_own_csrf_token() {
        let sessions = Arc::new(Sessions::default());
        let (alice_id, alice) = sessions.create(bearer("alice-token")).unwrap();
        let (_, bob) = sessions.create(bearer("bob-token")).unwrap();
        let app = app(sessions.clone());
        let cookie = format!("rota_session={alice_id}");
        let (status, _, body) = call(&app, Method::GET, "/v1/jobs", &[("cookie", &cookie)]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "alice-token"), "a read needs no CSRF token");
        for csrf in [None, Some(bob.csrf_token.as_str()), Some("0"), Some("")] {
            let mut headers = vec![("cookie", cookie.as_str())];
            headers.extend(csrf.map(|c| (CSRF_HEADER, c)));
            let (status, headers, body) = call(&app, Method::POST, "/v1/jobs", &headers).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "csrf {csrf:?}: {body}");
            assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
            let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(problem["field"], "X-CSRF-Token", "{problem}");
            assert!(problem["detail"].as_str().unwrap().contains("X-CSRF-Token"), "{problem}");
        }
        let (status, _, _) = call(&app, Method::DELETE, "/ui/session", &[("cookie", &cookie)]).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "signing out is a change too");
        let (status, _, body) = call(&app, Method::POST, "/v1/jobs", &[("cookie", &cookie), (CSRF_HEADER, &alice.csrf_token)]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "alice-token"));
    }

    /// An unknown, forged or expired cookie is refused 401; it never falls
    /// back to another way of authenticating.
    ///
    /// Shown to fail with the expiry check of [`SessionTable::get`] taken
    /// out: the 13-hour-old session was let through ("expected 401, got
    /// 200"); and with unknown cookies passed on unauthenticated, the
    /// forged one reached the handler ("expected 401, got 200").
    #[tokio::test]
    async fn unknown_forged_and_expired_sessions_are_refused() {
        let sessions = Arc::new(Sessions::default());
        let board = app(sessions.clone());
        for forged in ["rota_session=00", &format!("rota_session={}", "ab".repeat(32)), "rota_session="] {
            let (status, headers, body) = call(&board, Method::GET, "/v1/jobs", &[("cookie", forged)]).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{forged}: {body}");
            assert!(headers[header::SET_COOKIE].to_str().unwrap().contains("Max-Age=0"), "the browser is told to forget it");
        }
        // A session made 13 hours ago, and a clock that has moved on.
        let aged = Arc::new(Sessions::with_clock(later_ms));
        let (id, _) = aged.insert_at(bearer("alice-token"), crate::clock::wall_clock_ms());
        let (status, _, body) = call(&app(aged.clone()), Method::GET, "/v1/jobs", &[("cookie", &format!("rota_session={id}"))]).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert!(body.contains("expired"), "{body}");
        assert!(!cookie_applies("/v1/openapi.json") && !cookie_applies("/ui/board.js") && cookie_applies("/v1/events"));
        // The page itself is served whatever the cookie (it asks to sign in).
        let (status, _, body) = call(&board, Method::GET, "/ui", &[("cookie", "rota_session=00")]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "none"));
        // `Authorization` wins: the cookie is not looked at.
        let (status, _, body) =
            call(&board, Method::POST, "/v1/jobs", &[("cookie", "rota_session=00"), ("authorization", "Bearer x")]).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "none"));
    }

    /// Shown to fail with `HttpOnly` and `Secure` left out of the cookie
    /// ("HttpOnly in rota_session=abc; SameSite=Strict; ...").
    #[test]
    fn the_cookie_is_http_only_same_site_strict_and_secure_over_tls() {
        let tls = session_cookie("abc", true);
        let tls = tls.to_str().unwrap();
        for flag in ["rota_session=abc", "HttpOnly", "Secure", "SameSite=Strict", "Path=/"] {
            assert!(tls.split("; ").any(|part| part == flag), "{flag} in {tls}");
        }
        let plain = session_cookie("abc", false);
        assert!(!plain.to_str().unwrap().contains("Secure"), "plaintext listener: a Secure cookie would never be sent back");
    }

    #[test]
    fn a_sign_in_from_another_origin_is_refused() {
        let path: http::Uri = "/ui/session".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, "127.0.0.1:8443".parse().unwrap());
        assert!(check_same_origin(&path, &headers).is_ok(), "no Origin: not a browser's cross-site post");
        headers.insert(header::ORIGIN, "https://127.0.0.1:8443".parse().unwrap());
        assert!(check_same_origin(&path, &headers).is_ok());
        headers.insert(header::ORIGIN, "https://evil.example".parse().unwrap());
        assert_eq!(check_same_origin(&path, &headers).unwrap_err().status, 403);
        // HTTP/2: no Host header, the authority is in the URI.
        let h2: http::Uri = "https://127.0.0.1:8443/ui/session".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, "https://127.0.0.1:8443".parse().unwrap());
        assert!(check_same_origin(&h2, &headers).is_ok());
        headers.insert(header::ORIGIN, "https://evil.example".parse().unwrap());
        assert!(check_same_origin(&h2, &headers).is_err());
    }
}
