//! The REST/JSON API (`rota server --http-listen ADDR`), versioned under
//! `/v1`, for portals and scripts. Each request is authenticated as a gRPC
//! call would be ([`inbound`]), counted against its caller's limits, then
//! served by the gRPC service in this process, so followers forward and
//! the leader serves exactly as over gRPC. Errors are RFC 9457 problems
//! ([`problem`]); the OpenAPI document at `/v1/openapi.json` is derived
//! from the handlers below.

// A problem is made at most once per request, and is what the handlers
// answer with: its size costs nothing worth a box.
#![allow(clippy::result_large_err)]

pub mod board;
pub mod history;
pub mod inbound;
pub mod model;
pub mod problem;
pub mod session;

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use http::{header, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use rota_client::wire::REQUEST_ID_METADATA;
use rota_proto::v1 as pb;
use rota_proto::v1::auth_service_server::AuthService;
use rota_proto::v1::cluster_service_server::ClusterService;
use rota_proto::v1::event_service_server::EventService;
use rota_proto::v1::job_service_server::JobService;
use rota_tls::{ConnInfo, Security};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use utoipa::OpenApi;

use crate::limits::{limited_caller, Class, Limiter, Permit};
use crate::Context;
use inbound::Inbound;
use model::*;
use problem::Problem;

/// Largest request body, bytes.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Jobs per page by default, and at most.
const DEFAULT_PAGE_SIZE: u32 = 50;
const MAX_PAGE_SIZE: u32 = 500;
/// Nodes per page by default, and at most.
const DEFAULT_NODE_PAGE: u32 = 2_000;
const MAX_NODE_PAGE: u32 = 10_000;
/// Audit records per answer by default, and at most.
const DEFAULT_AUDIT_LIMIT: u32 = 100;
const MAX_AUDIT_LIMIT: u32 = 1_000;
/// Connections served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 4_096;
/// A client must send its request head within this time.
const HEADER_TIMEOUT_MS: u64 = 10_000;
/// An event stream with nothing to send sends a comment this often, so
/// proxies and clients see it alive.
const SSE_KEEP_ALIVE_MS: u64 = 15_000;

/// What the handlers share: the services they call, and the limiter the gRPC services use.
pub struct Rest {
    jobs: crate::jobs::JobApi,
    events: crate::events::EventApi,
    cluster: crate::cluster::ClusterApi,
    auth: crate::auth_api::AuthApi,
    limiter: Arc<Limiter>,
    /// The board's browser sessions (this replica's own).
    sessions: Arc<session::Sessions>,
    replica_id: u64,
}

impl Rest {
    fn replica_id(&self) -> u64 {
        self.replica_id
    }
}

type Shared = State<Arc<Rest>>;

#[derive(OpenApi)]
#[openapi(
    info(title = "rota REST API", description = "Jobs, nodes, queues, quotas, usage, cluster and audit of a rota cluster. \
        Authenticate with `Authorization: Bearer TOKEN` (from `rota token create`) or a user certificate. \
        Errors are RFC 9457 problems (application/problem+json)."),
    paths(
        submit_job, list_jobs, get_job, cancel_job, set_job_priority, why_job, job_logs, list_nodes, list_queues, list_quotas, get_usage, get_cluster,
        list_audit, watch_events, history::get_history, history::get_report
    ),
    components(schemas(Problem, LogStream, JobState, EventMessage, EventsCompacted, EventsProgress)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
}

/// The OpenAPI document, as served at `/v1/openapi.json`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

pub fn router(ctx: Arc<Context>, limiter: Arc<Limiter>) -> Router {
    let sessions = Arc::new(session::Sessions::default());
    let rest = Arc::new(Rest {
        replica_id: ctx.replica.node_id(),
        sessions: sessions.clone(),
        jobs: crate::jobs::JobApi::new(ctx.clone()),
        events: crate::events::EventApi::new(ctx.clone()),
        cluster: crate::cluster::ClusterApi::new(ctx.clone()),
        auth: crate::auth_api::AuthApi::new(ctx),
        limiter,
    });
    let document = Arc::new(openapi().to_json().unwrap_or_default());
    Router::new()
        .route("/v1/openapi.json", get(move || async move { ([(header::CONTENT_TYPE, "application/json")], document.to_string()) }))
        .route("/v1/jobs", post(submit_job).get(list_jobs))
        .route("/v1/jobs/{job_id}", get(get_job))
        .route("/v1/jobs/{job_id}/cancel", post(cancel_job))
        .route("/v1/jobs/{job_id}/priority", post(set_job_priority))
        .route("/v1/jobs/{job_id}/why", get(why_job))
        .route("/v1/jobs/{job_id}/logs", get(job_logs))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/queues", get(list_queues))
        .route("/v1/quotas", get(list_quotas))
        .route("/v1/usage", get(get_usage))
        .route("/v1/cluster", get(get_cluster))
        .route("/v1/audit", get(list_audit))
        .route("/v1/events", get(watch_events))
        .merge(board::routes())
        .route("/v1/history", get(history::get_history))
        .route("/v1/report", get(history::get_report))
        .fallback(|| async { Problem::not_found("no such resource; the API is under /v1 (see /v1/openapi.json)") })
        .method_not_allowed_fallback(|| async {
            Problem::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this resource does not take that method")
        })
        .with_state(rest)
        .layer(axum::middleware::from_fn_with_state(sessions, session::authenticate))
        .layer(axum::middleware::from_fn(read_whole_body))
        .layer(axum::middleware::from_fn(with_request_id))
}

/// Serve a request under the id its caller sent (`rota-request-id`, as
/// over gRPC) or a fresh one, and answer with it: the id names the
/// request's log lines, and a change sent twice under one id by its caller
/// (a retry after a lost answer) is applied once.
async fn with_request_id(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let id = crate::request_id::choose(request.headers().get(REQUEST_ID_METADATA));
    let header = id.header_value();
    let call = crate::request_id::Call::Rest { method: request.method().clone(), path: request.uri().path_and_query().cloned() };
    let served = crate::request_id::Served { id, call };
    let mut response = crate::request_id::serve_as(served, next.run(request)).await;
    response.headers_mut().insert(REQUEST_ID_METADATA, header);
    response
}

/// Bodies being read at once, over all connections: with [`MAX_BODY_BYTES`]
/// each, at most 64 MiB of bodies are buffered before anyone is known.
const MAX_BODY_READS: usize = 64;
/// A body must arrive within this; a client that trickles it is refused.
const BODY_READ_TIMEOUT_MS: u64 = 10_000;
static BODY_READS: Semaphore = Semaphore::const_new(MAX_BODY_READS);

/// Read every request's body whole (at most [`MAX_BODY_BYTES`]) before any
/// layer or handler answers it. An answer given while the client still
/// sends its body (a refusal, or a handler that takes no body, as cancel)
/// comes with a reset of the HTTP/2 stream, and clients such as curl then
/// report the reset instead of the answer. The reads happen before the
/// caller is known, so they are bounded in number and time as well as size.
async fn read_whole_body(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = request.into_parts();
    if axum::body::HttpBody::is_end_stream(&body) {
        return next.run(axum::extract::Request::from_parts(parts, body)).await;
    }
    match read_body_in_time(&parts.headers, body, Duration::from_millis(BODY_READ_TIMEOUT_MS)).await {
        Ok(bytes) => next.run(axum::extract::Request::from_parts(parts, Body::from(bytes))).await,
        Err(problem) => problem.into_response(),
    }
}

/// [`read_body`] under a permit of [`BODY_READS`], within `timeout`.
async fn read_body_in_time(headers: &http::HeaderMap, body: Body, timeout: Duration) -> Result<Bytes, Problem> {
    let reading = async {
        let _permit = BODY_READS.acquire().await.map_err(|_| Problem::new(StatusCode::SERVICE_UNAVAILABLE, "closing", "shutting down"))?;
        read_body(headers, body).await
    };
    tokio::time::timeout(timeout, reading).await.unwrap_or_else(|_| {
        Err(Problem::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", format!("the body did not arrive within {} ms", timeout.as_millis())))
    })
}

/// Serve the REST API on `listener` until the process ends: TLS with the
/// replica's certificate (clients may show a user certificate or send a
/// bearer token), or plaintext for a replica started `--insecure`.
pub async fn serve(router: Router, security: Security, listener: tokio::net::TcpListener) -> Result<(), String> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut incoming = security.incoming_http(listener).map_err(|e| e.to_string())?;
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    while let Some(conn) = incoming.next().await {
        let Ok(conn) = conn else { continue };
        let Ok(slot) = connections.clone().acquire_owned().await else { return Ok(()) };
        let info = conn.info().clone();
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(info.clone());
            tower::ServiceExt::oneshot(router.clone(), request)
        });
        tokio::spawn(async move {
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder.http1().timer(TokioTimer::new()).header_read_timeout(Duration::from_millis(HEADER_TIMEOUT_MS));
            if let Err(error) = builder.serve_connection(TokioIo::new(conn), service).await {
                tracing::debug!(%error, "REST connection ended with an error");
            }
            drop(slot);
        });
    }
    Ok(())
}

/// Authenticate a request and take its place in its caller's limits.
fn admit(rest: &Rest, parts: &Parts, stream: bool) -> Result<(Inbound, Option<Permit>), Problem> {
    let conn = parts.extensions.get::<ConnInfo>().ok_or_else(|| Problem::from(tonic::Status::unauthenticated("no connection")))?;
    let inbound = match parts.extensions.get::<session::SessionCaller>() {
        Some(session::SessionCaller(caller)) => Inbound::for_session(caller.clone(), conn.remote),
        None => Inbound::authenticate(conn, &parts.headers)?,
    };
    let permit = match limited_caller(&inbound.caller, inbound.remote.map(|a| a.ip()), false, Class::User) {
        None => None,
        Some((key, class)) => Some(rest.limiter.admit(&key, class, stream)?),
    };
    Ok((inbound, permit))
}

/// The caller of a request (authenticated, limits taken), as an extractor.
pub struct Caller {
    inbound: Inbound,
    _permit: Option<Permit>,
}

impl axum::extract::FromRequestParts<Arc<Rest>> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, rest: &Arc<Rest>) -> Result<Caller, Problem> {
        let (inbound, permit) = admit(rest, parts, false)?;
        Ok(Caller { inbound, _permit: permit })
    }
}

/// A query string parsed into `T`; bad input names its field.
fn query<T: DeserializeOwned + Default>(raw: Option<String>) -> Result<T, Problem> {
    let Some(raw) = raw.filter(|q| !q.is_empty()) else { return Ok(T::default()) };
    let deserializer = serde_urlencoded::Deserializer::new(form_urlencoded::parse(raw.as_bytes()));
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let field = Some(e.path().to_string()).filter(|path| path != ".").unwrap_or_else(|| "query".into());
        Problem::invalid(&field, format!("{field}: {}", e.inner()))
    })
}

fn job_id(raw: &str) -> Result<u64, Problem> {
    raw.parse::<u64>().ok().filter(|id| *id > 0).ok_or_else(|| Problem::invalid("job_id", format!("{raw:?} is not a job id")))
}

/// Read a body of at most [`MAX_BODY_BYTES`]. Read before anything else
/// is answered: a client still sending a body that is answered early gets
/// its HTTP/2 stream reset, and some clients report that instead of the answer.
async fn read_body(headers: &http::HeaderMap, body: Body) -> Result<Bytes, Problem> {
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|bytes| bytes > MAX_BODY_BYTES as u64) {
        return Err(Problem::too_large(MAX_BODY_BYTES));
    }
    match http_body_util::Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(Problem::too_large(MAX_BODY_BYTES)),
        Err(error) => Err(Problem::new(StatusCode::BAD_REQUEST, "bad_body", format!("reading the body: {error}"))),
    }
}

/// Read a JSON body of at most [`MAX_BODY_BYTES`]; bad input names its field.
#[cfg(test)]
async fn json_body<T: DeserializeOwned>(headers: &http::HeaderMap, body: Body) -> Result<T, Problem> {
    parse_json(&read_body(headers, body).await?)
}

/// A JSON body as `T`; bad input names its field.
fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        // The path names an unknown field too ("spec.gpus").
        let field = Some(e.path().to_string()).filter(|path| path != ".").unwrap_or_else(|| "body".into());
        let message = e.inner().to_string();
        Problem::invalid(&field, format!("{field}: {message}"))
    })
}

#[utoipa::path(
    post, path = "/v1/jobs", tag = "jobs",
    request_body = SubmitRequest,
    responses(
        (status = 201, description = "Submitted", body = Submitted),
        (status = 200, description = "The job an earlier submit with this request id made", body = Submitted),
        (status = 400, description = "Bad input; `field` names it", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The request id was used for another spec", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The body is over 1 MiB", body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn submit_job(State(rest): Shared, parts: Parts, body: Body) -> Result<Response, Problem> {
    let bytes = read_body(&parts.headers, body).await;
    let (inbound, _permit) = admit(&rest, &parts, false)?;
    let submit: SubmitRequest = parse_json(&bytes?)?;
    let answer = rest.jobs.submit_job(inbound.request(submit.to_pb())).await?.into_inner();
    let status = if answer.deduplicated { StatusCode::OK } else { StatusCode::CREATED };
    Ok((status, Json(Submitted::from(answer))).into_response())
}

#[utoipa::path(
    get, path = "/v1/jobs", tag = "jobs",
    params(ListJobsQuery),
    responses(
        (status = 200, body = JobPage),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_jobs(State(rest): Shared, caller: Caller, RawQuery(raw): RawQuery) -> Result<Json<JobPage>, Problem> {
    let filter: ListJobsQuery = query(raw)?;
    let limit = filter.limit.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&limit) {
        return Err(Problem::invalid("limit", format!("limit: must be 1..={MAX_PAGE_SIZE}")));
    }
    let before_id = match filter.cursor.as_deref() {
        None | Some("") => 0,
        Some(cursor) => cursor.parse::<u64>().map_err(|_| Problem::invalid("cursor", "cursor: not a cursor of this API"))?,
    };
    let state = match filter.state {
        None => pb::JobState::Unspecified,
        Some(state) => match state.to_pb() {
            Some(state) => state,
            None => return Ok(Json(JobPage { jobs: vec![], total: 0, next_cursor: None })),
        },
    };
    let labels = filter.label.map(|all| all.split(',').filter(|l| !l.is_empty()).map(str::to_string).collect()).unwrap_or_default();
    let request = pb::ListJobsRequest {
        state: state as i32,
        limit,
        group: filter.group.unwrap_or_default(),
        queue: filter.queue.unwrap_or_default(),
        user: filter.user.unwrap_or_default(),
        before_id,
        labels,
        idle: filter.idle.unwrap_or(false),
    };
    let page = rest.jobs.list_jobs(caller.inbound.request(request)).await?.into_inner();
    let next_cursor = page.truncated.then(|| page.jobs.last().map(|job| job.id.to_string())).flatten();
    Ok(Json(JobPage { jobs: page.jobs.into_iter().map(Job::from).collect(), total: page.total, next_cursor }))
}

async fn fetch_job(rest: &Rest, caller: &Caller, raw_id: &str) -> Result<Job, Problem> {
    let request = caller.inbound.request(pb::GetJobRequest { job_id: job_id(raw_id)? });
    let job = rest.jobs.get_job(request).await?.into_inner().job;
    job.map(Job::from).ok_or_else(|| Problem::from(tonic::Status::internal("the service answered without a job")))
}

#[utoipa::path(
    get, path = "/v1/jobs/{job_id}", tag = "jobs",
    params(("job_id" = u64, Path, description = "The job's id", minimum = 1)),
    responses(
        (status = 200, body = Job),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_job(State(rest): Shared, caller: Caller, Path(raw_id): Path<String>) -> Result<Json<Job>, Problem> {
    Ok(Json(fetch_job(&rest, &caller, &raw_id).await?))
}

#[utoipa::path(
    get, path = "/v1/jobs/{job_id}/why", tag = "jobs",
    params(("job_id" = u64, Path, description = "The job's id", minimum = 1)),
    responses(
        (status = 200, body = Why),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn why_job(State(rest): Shared, caller: Caller, Path(raw_id): Path<String>) -> Result<Json<Why>, Problem> {
    Ok(Json(Why::from(fetch_job(&rest, &caller, &raw_id).await?)))
}

#[utoipa::path(
    post, path = "/v1/jobs/{job_id}/cancel", tag = "jobs",
    params(("job_id" = u64, Path, description = "The job's id", minimum = 1)),
    responses(
        (status = 200, body = Cancelled),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 409, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn cancel_job(State(rest): Shared, caller: Caller, Path(raw_id): Path<String>) -> Result<Json<Cancelled>, Problem> {
    let job_id = job_id(&raw_id)?;
    let answer = rest.jobs.cancel_job(caller.inbound.request(pb::CancelJobRequest { job_id })).await?.into_inner();
    Ok(Json(Cancelled { job_id, state: JobState::from_pb(answer.state) }))
}

#[utoipa::path(
    post, path = "/v1/jobs/{job_id}/priority", tag = "jobs",
    params(("job_id" = u64, Path, description = "The job's id", minimum = 1)),
    request_body = PriorityChange,
    responses(
        (status = 200, description = "The job with its new priority", body = Job),
        (status = 400, description = "Bad input, or the job has ended", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Only the job's group admins and operators raise a priority; its owner may lower it", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 409, body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The body is over 1 MiB", body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn set_job_priority(State(rest): Shared, parts: Parts, Path(raw_id): Path<String>, body: Body) -> Result<Json<Job>, Problem> {
    let bytes = read_body(&parts.headers, body).await;
    let (inbound, _permit) = admit(&rest, &parts, false)?;
    let job_id = job_id(&raw_id)?;
    let change: PriorityChange = parse_json(&bytes?)?;
    let job = rest.jobs.set_job_priority(inbound.request(change.to_pb(job_id))).await?.into_inner();
    Ok(Json(Job::from(job)))
}

#[utoipa::path(
    get, path = "/v1/jobs/{job_id}/logs", tag = "jobs",
    params(("job_id" = u64, Path, description = "The job's id", minimum = 1), LogsQuery),
    responses(
        (status = 200, description = "The log's bytes, streamed (chunked)", body = String, content_type = "application/octet-stream"),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such job, or no such rank", body = Problem, content_type = "application/problem+json"),
        (status = 409, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn job_logs(State(rest): Shared, parts: Parts, Path(raw_id): Path<String>, RawQuery(raw): RawQuery) -> Result<Response, Problem> {
    // A stream: counted against the caller's open streams, until it ends.
    let (inbound, permit) = admit(&rest, &parts, true)?;
    let job_id = job_id(&raw_id)?;
    let options: LogsQuery = query(raw)?;
    let stream = match options.stream.unwrap_or_default() {
        LogStream::Stdout => "stdout",
        LogStream::Stderr => "stderr",
    };
    let follow = options.follow.unwrap_or(false);
    let request = pb::ReadLogRequest { job_id, rank: options.rank.unwrap_or(0), stream: stream.into(), follow, offset: 0 };
    let mut chunks = rest.jobs.read_logs(inbound.request(request)).await?.into_inner();
    // An error the agent answers at once (no such log) is a problem, not a
    // cut-off body; a followed log may have nothing to say yet, so it is not waited for.
    let first = if follow {
        None
    } else {
        match chunks.next().await {
            Some(Err(status)) => return Err(status.into()),
            other => other,
        }
    };
    let body = futures::stream::iter(first).chain(chunks).map(move |chunk| {
        let _held = &permit;
        chunk.map(|c| Bytes::from(c.data)).map_err(|status| std::io::Error::other(status.message().to_string()))
    });
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    Ok(response)
}

#[utoipa::path(
    get, path = "/v1/nodes", tag = "cluster",
    params(NodesQuery),
    responses(
        (status = 200, body = Nodes),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_nodes(State(rest): Shared, caller: Caller, RawQuery(raw): RawQuery) -> Result<Json<Nodes>, Problem> {
    let paging: NodesQuery = query(raw)?;
    let limit = paging.limit.unwrap_or(DEFAULT_NODE_PAGE);
    if !(1..=MAX_NODE_PAGE).contains(&limit) {
        return Err(Problem::invalid("limit", format!("limit: must be 1..={MAX_NODE_PAGE}")));
    }
    let all: Nodes = rest.cluster.list_nodes(caller.inbound.request(pb::ListNodesRequest {})).await?.into_inner().into();
    Ok(Json(node_page(all.nodes, paging.cursor.as_deref().unwrap_or(""), limit as usize)))
}

/// The page of at most `limit` nodes named after `cursor` ("": from the first).
fn node_page(mut nodes: Vec<Node>, cursor: &str, limit: usize) -> Nodes {
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    let start = nodes.partition_point(|n| n.name.as_str() <= cursor);
    let more = nodes.len() - start > limit;
    let page: Vec<Node> = nodes.drain(start..).take(limit).collect();
    let next_cursor = if more { page.last().map(|n| n.name.clone()) } else { None };
    Nodes { nodes: page, next_cursor }
}

#[utoipa::path(
    get, path = "/v1/queues", tag = "cluster",
    responses(
        (status = 200, body = Queues),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_queues(State(rest): Shared, caller: Caller) -> Result<Json<Queues>, Problem> {
    Ok(Json(rest.cluster.list_queues(caller.inbound.request(pb::ListQueuesRequest {})).await?.into_inner().into()))
}

#[utoipa::path(
    get, path = "/v1/quotas", tag = "cluster",
    responses(
        (status = 200, body = Quotas),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_quotas(State(rest): Shared, caller: Caller) -> Result<Json<Quotas>, Problem> {
    Ok(Json(rest.cluster.list_quotas(caller.inbound.request(pb::ListQuotasRequest {})).await?.into_inner().into()))
}

#[utoipa::path(
    get, path = "/v1/usage", tag = "cluster",
    responses(
        (status = 200, body = Usage),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_usage(State(rest): Shared, caller: Caller) -> Result<Json<Usage>, Problem> {
    Ok(Json(rest.cluster.get_usage(caller.inbound.request(pb::GetUsageRequest {})).await?.into_inner().into()))
}

#[utoipa::path(
    get, path = "/v1/cluster", tag = "cluster",
    responses(
        (status = 200, body = Cluster),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_cluster(State(rest): Shared, caller: Caller) -> Result<Json<Cluster>, Problem> {
    Ok(Json(rest.cluster.get_cluster_status(caller.inbound.request(pb::GetClusterStatusRequest {})).await?.into_inner().into()))
}

#[utoipa::path(
    get, path = "/v1/audit", tag = "cluster",
    params(AuditQuery),
    responses(
        (status = 200, body = Audit),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "Operators and admins read every user's records; others their own", body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_audit(State(rest): Shared, caller: Caller, RawQuery(raw): RawQuery) -> Result<Json<Audit>, Problem> {
    let filter: AuditQuery = query(raw)?;
    let limit = filter.limit.unwrap_or(DEFAULT_AUDIT_LIMIT);
    if !(1..=MAX_AUDIT_LIMIT).contains(&limit) {
        return Err(Problem::invalid("limit", format!("limit: must be 1..={MAX_AUDIT_LIMIT}")));
    }
    let request = pb::ListAuditRequest { user: filter.user.unwrap_or_default(), since_ms: filter.since_ms.unwrap_or(0), limit };
    Ok(Json(rest.auth.list_audit(caller.inbound.request(request)).await?.into_inner().into()))
}

#[utoipa::path(
    get, path = "/v1/events", tag = "events",
    params(
        EventsQuery,
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this index (an SSE client sends the last `id` it saw)"),
    ),
    responses(
        (status = 200, description = "Server-sent events, in log order: each `event: KIND` with `data:` an EventMessage; \
            `id: INDEX` on the last event of each log entry; `event: compacted` (data EventsCompacted) when the \
            entries asked for are no longer kept, then the stream ends; `event: progress` (data EventsProgress, \
            `id` its index) every few seconds at most while entries pass with no event the topics match; \
            `event: error` (data a Problem) when the stream is cut off (a reader too slow); comment lines keep \
            it alive", body = String, content_type = "text/event-stream"),
        (status = 400, description = "Bad `since`, `topic` or `Last-Event-ID`; `field` names it", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
    )
)]
async fn watch_events(State(rest): Shared, parts: Parts, RawQuery(raw): RawQuery) -> Result<Response, Problem> {
    // A stream: counted against the caller's open streams, until it ends.
    let (inbound, permit) = admit(&rest, &parts, true)?;
    let options: EventsQuery = query(raw)?;
    let topics: Vec<String> =
        options.topic.unwrap_or_default().split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_string).collect();
    crate::events::parse_topics(topics.iter().map(String::as_str), "topic").map_err(|message| Problem::invalid("topic", message))?;
    let since = match parts.headers.get("last-event-id") {
        None => options.since.unwrap_or(0),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .ok_or_else(|| Problem::invalid("Last-Event-ID", "Last-Event-ID: not an index this stream sent (a whole number)"))?,
    };
    let request = inbound.request(pb::WatchEventsRequest { since_index: since, topics });
    let stream = match rest.events.watch_events(request).await {
        Ok(stream) => stream.into_inner(),
        Err(status) if status.code() == tonic::Code::InvalidArgument && status.message().starts_with("since_index") => {
            return Err(Problem::invalid("since", status.message().replacen("since_index", "since", 1)));
        }
        Err(status) => return Err(status.into()),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(SSE_KEEP_ALIVE_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let body = futures::stream::unfold((stream, tick, false, permit), |(mut stream, mut tick, done, permit)| async move {
        if done {
            return None;
        }
        tokio::select! {
            next = stream.next() => match next {
                Some(Ok(message)) => {
                    let finished = message.compacted.is_some();
                    Some((Ok::<_, std::io::Error>(Bytes::from(sse_frames(message))), (stream, tick, finished, permit)))
                }
                Some(Err(status)) => {
                    let problem = Problem::from(status);
                    let frame = format!("event: error\ndata: {}\n\n", serde_json::to_string(&problem).unwrap_or_default());
                    Some((Ok(Bytes::from(frame)), (stream, tick, true, permit)))
                }
                None => None,
            },
            _ = tick.tick() => Some((Ok(Bytes::from_static(b": keep-alive\n\n")), (stream, tick, false, permit))),
        }
    });
    let mut response = Body::from_stream(body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

/// One gRPC message as SSE messages: one per event, `id` on the last of
/// each entry (so a browser's remembered id never splits an entry), or
/// the `compacted` message.
fn sse_frames(message: pb::WatchEventsResponse) -> String {
    let mut text = String::new();
    if let Some(compacted) = message.compacted {
        let data = EventsCompacted { oldest_index: compacted.oldest_index, current_index: compacted.current_index };
        text.push_str(&format!("event: compacted\ndata: {}\n\n", serde_json::to_string(&data).unwrap_or_default()));
        return text;
    }
    if message.events.is_empty() && message.progress_index > 0 {
        // Its id is where a reconnecting EventSource resumes.
        let index = message.progress_index;
        let data = serde_json::to_string(&EventsProgress { index }).unwrap_or_default();
        text.push_str(&format!("event: progress\nid: {index}\ndata: {data}\n\n"));
        return text;
    }
    let count = message.events.len();
    let indexes: Vec<u64> = message.events.iter().map(|e| e.index).collect();
    for (i, event) in message.events.into_iter().enumerate() {
        let last_of_entry = i + 1 == count || indexes[i + 1] != event.index;
        let index = event.index;
        // Kinds are rota's own words ([a-z_]), so never break the framing.
        text.push_str(&format!("event: {}\n", event.kind));
        if last_of_entry {
            text.push_str(&format!("id: {index}\n"));
        }
        let data = serde_json::to_string(&EventMessage::from(event)).unwrap_or_default();
        text.push_str(&format!("data: {data}\n\n"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that opens a body and never finishes it is refused in
    /// time, and gives its read permit back.
    #[tokio::test]
    async fn a_body_that_never_arrives_is_refused_in_time() {
        let never = futures::stream::pending::<Result<Bytes, std::io::Error>>();
        let body = Body::from_stream(never);
        let refused = read_body_in_time(&http::HeaderMap::new(), body, Duration::from_millis(50)).await.unwrap_err();
        assert_eq!(refused.status, 408, "{refused:?}");
        assert_eq!(BODY_READS.available_permits(), MAX_BODY_READS);
    }

    #[test]
    fn the_openapi_document_names_every_operation_and_its_problems() {
        let document: serde_json::Value = serde_json::from_str(&openapi().to_json().expect("serializes")).expect("JSON");
        let paths = document["paths"].as_object().expect("paths");
        for path in [
            "/v1/jobs",
            "/v1/jobs/{job_id}",
            "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/why",
            "/v1/jobs/{job_id}/logs",
            "/v1/nodes",
            "/v1/queues",
            "/v1/quotas",
            "/v1/usage",
            "/v1/cluster",
            "/v1/audit",
            "/v1/events",
            "/v1/history",
            "/v1/report",
        ] {
            assert!(paths.contains_key(path), "{path} in {:?}", paths.keys());
        }
        let submit = &document["paths"]["/v1/jobs"]["post"];
        assert!(submit["responses"]["400"]["content"]["application/problem+json"].is_object(), "{submit}");
        assert!(document["components"]["schemas"]["Problem"].is_object());
        let submit_schema = &document["components"]["schemas"]["SubmitRequest"]["properties"];
        for field in ["labels", "template", "template_version", "spec"] {
            assert!(submit_schema[field].is_object(), "SubmitRequest.{field}: {submit_schema}");
        }
        assert!(document["components"]["securitySchemes"]["bearer"].is_object());
    }

    #[test]
    fn nodes_page_by_name() {
        let node = |name: &str| Node {
            name: name.into(),
            address: String::new(),
            rack: String::new(),
            leaf: String::new(),
            state: "ready".into(),
            gpus: vec![],
            registered_at_ms: 0,
        };
        let names = |page: &Nodes| page.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>();
        let all = vec![node("c"), node("a"), node("b")];
        let first = node_page(all.clone(), "", 2);
        assert_eq!((names(&first), first.next_cursor.as_deref()), (vec!["a".to_string(), "b".into()], Some("b")));
        let second = node_page(all.clone(), "b", 2);
        assert_eq!((names(&second), second.next_cursor), (vec!["c".to_string()], None));
        assert_eq!(node_page(all, "", 3).next_cursor, None, "exactly a page: no next");
    }

    #[test]
    fn sse_puts_the_id_on_the_last_event_of_each_entry_only() {
        let event = |index, seq, kind: &str| pb::Event { index, seq, kind: kind.into(), topic: "jobs".into(), ..Default::default() };
        let message = pb::WatchEventsResponse {
            progress_index: 0,
            events: vec![event(7, 0, "job_submitted"), event(7, 1, "job_submitted"), event(9, 0, "job_placed")],
            compacted: None,
        };
        let text = sse_frames(message);
        let frames: Vec<&str> = text.split("\n\n").filter(|f| !f.is_empty()).collect();
        assert_eq!(frames.len(), 3, "{text}");
        assert!(frames[0].starts_with("event: job_submitted\ndata: {") && !frames[0].contains("id:"), "{text}");
        assert!(frames[1].starts_with("event: job_submitted\nid: 7\ndata: {"), "{text}");
        assert!(frames[2].starts_with("event: job_placed\nid: 9\ndata: {"), "{text}");
        let compacted =
            pb::WatchEventsResponse { compacted: Some(pb::EventsCompacted { oldest_index: 40, current_index: 52 }), ..Default::default() };
        assert_eq!(sse_frames(compacted), "event: compacted\ndata: {\"oldest_index\":40,\"current_index\":52}\n\n");
        let progress = crate::events::progress_message(61);
        assert_eq!(sse_frames(progress), "event: progress\nid: 61\ndata: {\"index\":61}\n\n");
    }

    #[tokio::test]
    async fn bad_bodies_name_their_field_and_large_ones_are_refused() {
        let headers = http::HeaderMap::new();
        let parse = |text: &str| json_body::<SubmitRequest>(&headers, Body::from(text.to_string()));
        let unknown = parse(r#"{"spec": {"gpus": 2}}"#).await.unwrap_err();
        assert_eq!((unknown.status, unknown.field.as_deref()), (400, Some("spec.gpus")), "{unknown:?}");
        let wrong = parse(r#"{"spec": {"replicas": "two"}}"#).await.unwrap_err();
        assert_eq!(wrong.field.as_deref(), Some("spec.replicas"), "{wrong:?}");
        let garbage = parse("not json").await.unwrap_err();
        assert_eq!(garbage.field.as_deref(), Some("body"), "{garbage:?}");
        let large = parse(&format!(r#"{{"spec": {{"name": "{}"}}}}"#, "x".repeat(MAX_BODY_BYTES))).await.unwrap_err();
        assert_eq!(large.status, 413);
        let fine = parse(r#"{"spec": {"command": ["true"]}}"#).await.expect("a spec").to_pb();
        let spec = fine.spec.expect("a spec");
        assert_eq!((spec.replicas, spec.gpus_per_replica, spec.priority), (1, 1, pb::Priority::Medium as i32));
        let label = parse(r#"{"labels": {"team": 7}}"#).await.unwrap_err();
        assert_eq!(label.field.as_deref(), Some("labels.team"), "{label:?}");
    }

    /// With a template, what the spec leaves out stays unset (zero), so
    /// the template's value holds, as a gRPC submit's does.
    #[tokio::test]
    async fn a_template_submit_leaves_unset_fields_to_the_template() {
        let headers = http::HeaderMap::new();
        let body = r#"{"template": "asr", "template_version": 2, "spec": {"gpus_per_replica": 4}, "labels": {"paper": "q4"}}"#;
        let submit = json_body::<SubmitRequest>(&headers, Body::from(body)).await.expect("a submit").to_pb();
        assert_eq!((submit.template.as_str(), submit.template_version), ("asr", 2));
        assert_eq!(submit.labels.get("paper").map(String::as_str), Some("q4"));
        let spec = submit.spec.expect("a spec");
        assert_eq!((spec.replicas, spec.gpus_per_replica, spec.priority), (0, 4, pb::Priority::Unspecified as i32));
        assert!(spec.command.is_empty() && spec.group.is_empty(), "{spec:?}");
    }
}
