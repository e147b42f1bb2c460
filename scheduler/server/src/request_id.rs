//! One id per client action, in every log line it causes. A request keeps
//! the id its client sent (`rota-request-id`, see `rota_client::wire`) or
//! gets a fresh one; the replica answers with it in the same header, serves
//! the request with it (and what was called) in a task-local that every
//! log line written while serving it shows as its `request` (see
//! `log_format`), and hands it on: to the leader when a follower forwards,
//! and to the proposer, which puts it into the log entry so that apply on
//! every replica names it too.
//!
//! The request is not a tracing span: a span per request cost a few per
//! cent of a busy leader (its fields formatted into a string of their own,
//! a slot in the span registry, the filter consulted at every poll), almost
//! always for no log line at all. The task-local costs a move per request,
//! and the text is written only with a line that needs it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderValue;
use rota_client::wire::{is_request_id, new_request_id, REQUEST_ID_METADATA};
use tonic::body::Body;
use tonic::server::NamedService;

/// A request's id, and whether its client chose it (only such an id is
/// the same on a retry, so only it can make a change happen once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId {
    pub id: String,
    pub from_client: bool,
}

/// A request being served: its id and what was called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub id: RequestId,
    pub call: Call,
}

/// What a request called, as its log lines name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A gRPC method, by its path (`/rota.v1.JobService/SubmitJob`).
    Grpc { method: Option<http::uri::PathAndQuery> },
    /// A REST call: the HTTP method and the path.
    Rest { method: http::Method, path: Option<http::uri::PathAndQuery> },
}

tokio::task_local! {
    /// The request the current task serves.
    static CURRENT: Served;
}

/// The id of the request this task serves, if it serves one.
pub fn current() -> Option<String> {
    CURRENT.try_with(|current| current.id.id.clone()).ok()
}

/// The id of the request this task serves, if its client sent it.
pub fn current_from_client() -> Option<String> {
    CURRENT.try_with(|current| current.id.from_client.then(|| current.id.id.clone())).ok().flatten()
}

/// `with(Some(request))` inside a request, `with(None)` outside one.
pub fn with_current<R>(with: impl FnOnce(Option<&Served>) -> R) -> R {
    let mut with = Some(with);
    match CURRENT.try_with(|current| (with.take().expect("called once"))(Some(current))) {
        Ok(answer) => answer,
        Err(_) => (with.take().expect("not called yet"))(None),
    }
}

/// Serve `answer` as the request `served` (the REST API's requests, which
/// do not pass through `Traced`).
pub async fn serve_as<F: Future>(served: Served, answer: F) -> F::Output {
    CURRENT.scope(served, answer).await
}

impl RequestId {
    /// The id as a header. One made up here is marked never to be indexed
    /// by HTTP/2's header compression: it names one request only, so an
    /// entry in the connection's table would never be used again, yet each
    /// response would search the table for it and evict an older entry to
    /// insert it. A client's own id is usually the same for all of its
    /// calls and is indexed as it came.
    pub fn header_value(&self) -> HeaderValue {
        let mut header = HeaderValue::from_str(&self.id).expect("a request id is a valid header value");
        header.set_sensitive(!self.from_client);
        header
    }
}

/// The id a request carries if well formed, else a fresh one: a header is
/// the caller's to choose, so a malformed one (too long, odd characters
/// that would garble a log line) is replaced rather than refused.
pub fn choose(header: Option<&HeaderValue>) -> RequestId {
    match header.and_then(|value| value.to_str().ok()) {
        Some(id) if is_request_id(id) => RequestId { id: id.to_string(), from_client: true },
        _ => RequestId { id: new_request_id(), from_client: false },
    }
}

/// A gRPC service whose requests each run with their id (see the module).
#[derive(Clone)]
pub struct Traced<S> {
    inner: S,
}

impl<S> Traced<S> {
    pub fn new(inner: S) -> Traced<S> {
        Traced { inner }
    }
}

impl<S: NamedService> NamedService for Traced<S> {
    const NAME: &'static str = S::NAME;
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Traced<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> ResponseFuture {
        let id = choose(request.headers().get(REQUEST_ID_METADATA));
        let header = id.header_value();
        request.headers_mut().insert(REQUEST_ID_METADATA, header.clone());
        let call = Call::Grpc { method: request.uri().path_and_query().cloned() };
        let answer = self.inner.call(request);
        let served = CURRENT.scope(Served { id, call }, answer);
        Box::pin(async move {
            let mut response = served.await?;
            response.headers_mut().insert(REQUEST_ID_METADATA, header);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_id_is_kept_and_any_other_replaced() {
        assert_eq!(choose(Some(&HeaderValue::from_static("cli-42"))), RequestId { id: "cli-42".into(), from_client: true });
        let long = "a".repeat(rota_client::wire::MAX_REQUEST_ID_BYTES + 1);
        for bad in [None, Some(HeaderValue::from_static("a b")), Some(HeaderValue::from_str(&long).expect("ascii"))] {
            let chosen = choose(bad.as_ref());
            assert!(is_request_id(&chosen.id) && chosen.id.len() == 16 && !chosen.from_client, "{bad:?} -> {chosen:?}");
        }
    }

    #[test]
    fn only_a_made_up_id_is_kept_out_of_the_compression_table() {
        let made = choose(None).header_value();
        assert!(made.is_sensitive(), "a fresh id per response would churn HPACK's table");
        let given = choose(Some(&HeaderValue::from_static("cli-42"))).header_value();
        assert!(!given.is_sensitive() && given == "cli-42");
    }

    #[tokio::test]
    async fn a_response_carries_its_id_and_a_made_up_one_is_never_indexed() {
        use tower::{Service, ServiceExt};
        let echo = tower::service_fn(|_: http::Request<()>| async { Ok::<_, Infallible>(http::Response::new(Body::empty())) });
        let mut traced = Traced::new(echo);
        let made = traced.ready().await.expect("ready").call(http::Request::new(())).await.expect("infallible");
        let header = made.headers().get(REQUEST_ID_METADATA).expect("an id answered");
        assert!(header.is_sensitive() && is_request_id(header.to_str().expect("ascii")));
        let asked = http::Request::builder().header(REQUEST_ID_METADATA, "cli-7").body(()).expect("a request");
        let given = traced.ready().await.expect("ready").call(asked).await.expect("infallible");
        let header = given.headers().get(REQUEST_ID_METADATA).expect("an id answered");
        assert!(!header.is_sensitive() && header == "cli-7");
    }

    #[tokio::test]
    async fn the_id_is_the_current_one_inside_its_request_only() {
        assert_eq!(current(), None);
        let call = Call::Grpc { method: None };
        let given = Served { id: RequestId { id: "r-1".into(), from_client: true }, call: call.clone() };
        let seen = CURRENT.scope(given, async { (current(), current_from_client()) }).await;
        assert_eq!(seen, (Some("r-1".to_string()), Some("r-1".to_string())));
        let made = Served { id: RequestId { id: "r-2".into(), from_client: false }, call };
        let seen = CURRENT.scope(made, async { (current(), current_from_client()) }).await;
        assert_eq!(seen, (Some("r-2".to_string()), None), "a made-up id cannot match a retry");
        assert!(with_current(|served| served.is_none()), "outside any request");
    }
}
